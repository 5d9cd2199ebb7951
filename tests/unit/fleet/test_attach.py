"""`hpd demo --attach --tls-dir`: the role certificates it presents are the files `hpd certs`
writes, found by the names ``hpd_tools.tlsgen`` gives them (one home for those names), and
a folder without them is refused before anything starts, naming what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpd_fleet import demo
from hpd_fleet.attach import role_identity
from hpd_tools import tlsgen


@pytest.mark.parametrize("role", ["worker", "gateway"])
def test_a_role_presents_the_certificate_tlsgen_wrote(tmp_path: Path, role: str) -> None:
    pki = tlsgen.ensure_pki(tmp_path)
    cert, key = pki.role_cert(role)
    ident = role_identity(tmp_path, role)
    assert (ident.ca_file, ident.cert_file, ident.key_file) == (str(pki.ca), str(cert), str(key))


def test_the_names_come_from_tlsgen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Renamed in tlsgen, found under the new names: the rule is not written out again."""

    def elsewhere(self: tlsgen.Pki, role: str) -> tuple[Path, Path]:
        folder = self.ca.parent / "roles"
        return folder / f"{role}.crt", folder / f"{role}.key"

    monkeypatch.setattr(tlsgen.Pki, "role_cert", elsewhere)
    (tmp_path / "roles").mkdir()
    for name in ("ca.pem", "roles/worker.crt", "roles/worker.key"):
        (tmp_path / name).write_text("-")
    ident = role_identity(tmp_path, "worker")
    assert ident.cert_file == str(tmp_path / "roles" / "worker.crt")
    assert ident.key_file == str(tmp_path / "roles" / "worker.key")
    with pytest.raises(ValueError, match=r"no gateway\.crt, gateway\.key there"):
        role_identity(tmp_path, "gateway")


def test_a_folder_without_the_files_is_named_and_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError) as info:
        role_identity(tmp_path, "worker")
    assert str(info.value) == (
        f"--tls-dir {tmp_path}: no ca.pem, role-worker.pem, role-worker.key there (see `hpd certs`)"
    )
    tlsgen.ensure_pki(tmp_path)
    (tmp_path / "role-gateway.key").unlink()
    code = demo.main(["--attach", "r:1,s:2,k:3", "--tls-dir", str(tmp_path), "--no-serve"])
    assert code == 2
    assert f"--tls-dir {tmp_path}: no role-gateway.key there" in capsys.readouterr().err
