"""An emulated heterogeneous inference fleet, the worker client library it is built on, a
gateway that replays request traces through the real control plane, and `hpd demo`."""
