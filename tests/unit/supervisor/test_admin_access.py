"""The admin key of Triton's restricted API groups: where it comes from, what it makes
of tritonserver's command line, and what it refuses."""

import os
import stat

import pytest

from clients.tritonserver import server_command
from supervisor.admin_access import AdminAccess, AdminKeyError, parse_groups, resolve

KEY = "k" * 20


def test_restricts_every_group_but_the_opened_ones_on_http_and_grpc():
    args = AdminAccess(KEY).server_args()
    spec = f"model-repository,shared-memory,logging,trace,model-config:admin-key={KEY}"
    assert args == [f"--http-restricted-api={spec}", f"--grpc-restricted-protocol={spec}"]
    opened = AdminAccess(KEY, ("model-config", "trace")).server_args()[0]
    assert opened == f"--http-restricted-api=model-repository,shared-memory,logging:admin-key={KEY}"


def test_model_repository_cannot_be_opened_and_unknown_groups_are_named():
    with pytest.raises(AdminKeyError, match="'model-repository' is always restricted"):
        parse_groups(["model-repository"])
    with pytest.raises(AdminKeyError, match="unknown API group 'inference'"):
        parse_groups(["trace,inference"])
    assert parse_groups(["trace, logging", "model-config"]) == ("trace", "logging", "model-config")


def test_key_sources_in_order(tmp_path):
    f = tmp_path / "key"
    f.write_text("f" * 24 + "\n")
    assert resolve(key=KEY, environ={"TRITON_ADMIN_KEY": "e" * 20}).key == KEY
    assert resolve(environ={"TRITON_ADMIN_KEY": "e" * 20, "TRITON_ADMIN_KEY_FILE": str(f)}).key == "e" * 20
    from_file = resolve(environ={"TRITON_ADMIN_KEY_FILE": str(f)})
    assert from_file.key == "f" * 24 and not from_file.generated
    assert resolve(environ={"TRITON_UNRESTRICTED_APIS": "trace"}).unrestricted == ("trace",)


def test_generated_key_is_written_for_its_user_only():
    a, b = resolve(write_generated=True, environ={}), resolve(environ={})
    try:
        assert a.generated and a.key != b.key and len(a.key) >= 32
        assert open(a.key_file).read().strip() == a.key
        assert stat.S_IMODE(os.stat(a.key_file).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(a.key_file)).st_mode) == 0o700
    finally:
        os.remove(a.key_file)
        os.rmdir(os.path.dirname(a.key_file))


@pytest.mark.parametrize("bad", ["short", "has:colon-in-it-000", "has=equals-in-it-00", "has space in it 0000",
                                 "comma,in,it,0000000"])
def test_keys_triton_cannot_parse_are_refused_by_name(bad):
    with pytest.raises(AdminKeyError, match="TRITON_ADMIN_KEY: the admin key must be"):
        resolve(environ={"TRITON_ADMIN_KEY": bad})


def test_missing_key_file_is_named(tmp_path):
    with pytest.raises(AdminKeyError, match=f"admin key file {tmp_path}/nope"):
        resolve(environ={"TRITON_ADMIN_KEY_FILE": str(tmp_path / "nope")})


def test_server_command_binds_the_host_and_redacts_the_key():
    access = AdminAccess(KEY)
    cmd = server_command("repo", 1, 2, 3, access)
    for flag in ("--http-address", "--grpc-address", "--metrics-address"):
        assert cmd[cmd.index(flag) + 1] == "127.0.0.1"
    assert any(KEY in a for a in cmd) and not any(KEY in a for a in access.redact(cmd))
    assert server_command("repo", 1, 2, 3, access, host="0.0.0.0")[cmd.index("--http-address") + 1] == "0.0.0.0"
