"""hetero-pd."""

from hpd_common import native as _native

# the compiled modules of this package, when built and current (hpd_common.native)
__path__ = _native.search_path(__name__, __path__)
