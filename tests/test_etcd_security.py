"""etcd as sites run it: TLS with client certificates and etcd users (the
signed values are in tests/test_faults_etcd.py).

The secure member is a real etcd started by the test with `https://` client URLs,
`--client-cert-auth` and authentication enabled (a root user and a `rally` user whose role may
read and write `rally/`); the CA, the server's and the client's certificates are made by the
test with openssl. The member runs in its own session and is killed by process group; ports
come from the OS.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rally.rendezvous.etcd.client import Member
from rally.rendezvous.etcd.http import EtcdAccess
from rally.rendezvous.etcd.open import open_etcd_store
from support.agents import start_agent, stop_all
from support.etcd_cluster import ETCD
from support.helpers import eventually, free_port, run_rally, write_probe
from test_bad_input import assert_one_line_only, rally_fails, the_error_line
from test_etcd import PROBE

ETCDCTL = shutil.which("etcdctl")
needs_etcdctl = pytest.mark.skipif(ETCD is None or ETCDCTL is None, reason="etcd and etcdctl are not installed")
OPENSSL = shutil.which("openssl")


# ---------------------------------------------------------------- certificates and a secure member
def make_certificates(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    if OPENSSL is None:
        pytest.skip("openssl is not installed")

    def run(*args: str) -> None:
        subprocess.run([OPENSSL, *args], cwd=directory, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=rally test CA")
    # The client certificate has no Common Name: with authentication on, etcd's HTTP gateway
    # refuses one that has (etcd would take the CN for a user name); `client-cn` shows that.
    certificates = (
        ("server", "serverAuth,clientAuth", "/CN=rally-server"),
        ("client", "clientAuth", "/O=rally"),
        ("client-cn", "clientAuth", "/CN=rally-client"),
    )
    for name, usage, subject in certificates:
        (directory / f"{name}.ext").write_text(f"subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage={usage}\n")
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject)
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")  # fmt: skip
    return {
        name: directory / name
        for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key", "client-cn.pem", "client-cn.key")
    }


@dataclass
class SecureEtcd:
    endpoint: str  # 127.0.0.1:PORT
    files: dict[str, Path]
    password_file: Path
    process: subprocess.Popen

    def conf(self, **override: str) -> str:
        """--rdzv-conf keys that reach this member as the `rally` user."""
        keys = {
            "protocol": "https", "cacert": str(self.files["ca.pem"]), "cert": str(self.files["client.pem"]),
            "key": str(self.files["client.key"]), "username": "rally", "password_file": str(self.password_file),
        }  # fmt: skip
        keys.update(override)
        return ",".join(f"{k}={v}" for k, v in keys.items() if v)

    def etcdctl(self, *args: str, user: str = "root:rootpw") -> subprocess.CompletedProcess:
        command = [
            str(ETCDCTL), f"--endpoints=https://{self.endpoint}", f"--cacert={self.files['ca.pem']}",
            f"--cert={self.files['client.pem']}", f"--key={self.files['client.key']}", *args,
        ]  # fmt: skip
        if user:
            command.insert(1, f"--user={user}")
        return subprocess.run(
            command, capture_output=True, text=True, timeout=30, env={**os.environ, "ETCDCTL_API": "3"}
        )


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    """One etcd member with TLS, client certificates and authentication enabled, shared by the
    module's tests (its certificates and users take a second to make; no test changes them, and
    each job has a run id of its own)."""
    yield from start_secure_etcd(tmp_path_factory.mktemp("secure-etcd"))


def start_secure_etcd(tmp_path: Path, *extra: str) -> Iterator[SecureEtcd]:
    if ETCD is None or ETCDCTL is None:
        pytest.skip("etcd and etcdctl are not installed")
    files = make_certificates(tmp_path)
    client_port, peer_port = free_port(), free_port()
    while peer_port == client_port:
        peer_port = free_port()
    url, peer = f"https://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    log = open(tmp_path / "etcd.log", "ab")  # owned by the child
    process = subprocess.Popen(
        [
            str(ETCD), "--name", "secure", "--data-dir", str(tmp_path / "etcd.data"),
            "--listen-client-urls", url, "--advertise-client-urls", url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"secure={peer}",
            "--cert-file", str(files["server.pem"]), "--key-file", str(files["server.key"]),
            "--trusted-ca-file", str(files["ca.pem"]), "--client-cert-auth",
            "--logger", "zap", "--log-level", "warn", *extra,
        ],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    log.close()
    password_file = tmp_path / "etcd-password"
    password_file.write_text("rally-secret\n")
    member = SecureEtcd(f"127.0.0.1:{client_port}", files, password_file, process)
    try:
        assert eventually(lambda: member.etcdctl("endpoint", "health", user="").returncode == 0, 30), (
            tmp_path / "etcd.log"
        ).read_text()
        for args in (
            ("role", "add", "root"), ("user", "add", "root:rootpw"), ("user", "grant-role", "root", "root"),
            ("role", "add", "rally"), ("role", "grant-permission", "rally", "--prefix=true", "readwrite", "rally/"),
            ("user", "add", "rally:rally-secret"), ("user", "grant-role", "rally", "rally"), ("auth", "enable"),
        ):  # fmt: skip
            done = member.etcdctl(*args, user="")
            assert done.returncode == 0, f"etcdctl {' '.join(args)}: {done.stderr}"
        yield member
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def job_args(endpoints: str, run_id: str, conf: str, probe: Path, steps: Path, seconds: float) -> list[str]:
    return [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoints,
        "--rdzv-id", run_id, "--local-addr", "127.0.0.1", "--shutdown-timeout", "3",
        "--rdzv-conf", f"join_timeout=60,last_call_timeout=1,keep_alive_interval=0.2,keep_alive_timeout=5,{conf}",
        str(probe), str(steps), "2", str(seconds),
    ]  # fmt: skip


# ---------------------------------------------------------------- TLS and etcd users
@needs_etcdctl
@pytest.mark.timeout(240)
def test_a_job_runs_on_etcd_with_tls_client_certificates_and_an_etcd_user(secure_etcd, tmp_path):
    probe, steps = write_probe(tmp_path / "probe.py", PROBE), tmp_path / "steps.jsonl"
    run_id = f"job-{uuid.uuid4().hex[:8]}"
    args = job_args(f"https://{secure_etcd.endpoint}", run_id, secure_etcd.conf(protocol=""), probe, steps, 3)
    agents = [start_agent(f"n{i}", tmp_path, args) for i in range(2)]
    try:
        stepping = lambda: steps.exists() and len(steps.read_text().splitlines()) > 10  # noqa: E731
        assert eventually(lambda: stepping() or any(a.popen.poll() is not None for a in agents), 120) and stepping(), (
            agents[0].output()
        )
        status = run_rally(
            ["status", "--rdzv-backend", "etcd", "--rdzv-endpoint", secure_etcd.endpoint, "--rdzv-id", run_id,
             "--rdzv-conf", secure_etcd.conf()], cwd=tmp_path, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0 and f"job {run_id} at etcd at https://{secure_etcd.endpoint}" in status.stdout, (
            status.describe()
        )
        codes = [agent.wait(120) for agent in agents]
        assert codes == [0, 0], "\n".join(a.output() for a in agents)
    finally:
        stop_all(agents)
    worlds = {json.loads(line)["WORLD_SIZE"] for line in steps.read_text().splitlines()}
    assert worlds == {"2"}
    keys = secure_etcd.etcdctl("get", "--prefix", "--keys-only", f"rally/{run_id}/0/end")
    assert keys.returncode == 0 and f"rally/{run_id}/0/end" in keys.stdout, keys.stderr
    refused = secure_etcd.etcdctl("get", "--prefix", f"rally/{run_id}/", user="")
    assert refused.returncode != 0, "without a user, etcd itself refuses a stranger"


@needs_etcdctl
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "override, expected",
    [
        pytest.param({"password_file": "", "password": "a-guess"}, "refused rally", id="wrong-password"),
        pytest.param({"username": "", "password_file": ""}, "refused rally", id="no-user"),
        pytest.param({"cert": "", "key": ""}, "TLS", id="no-client-certificate"),
        pytest.param({"cacert": "client.pem"}, "TLS", id="wrong-ca"),
        pytest.param(
            {"cert": "client-cn.pem", "key": "client-cn.key"}, "a certificate without a CN", id="certificate-with-cn"
        ),
    ],
)
def test_wrong_etcd_credentials_are_one_line_and_exit_2(secure_etcd, tmp_path, override, expected):
    for name in ("cacert", "cert", "key"):
        if override.get(name):
            override[name] = str(secure_etcd.files[override[name]])
    conf = secure_etcd.conf(**override)
    started = time.monotonic()
    result = rally_fails(
        tmp_path, "--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", secure_etcd.endpoint,
        "--rdzv-id", "x", "--rdzv-conf", conf, "train.py",
    )  # fmt: skip
    line = the_error_line(result)
    assert expected in line and secure_etcd.endpoint in line, line
    assert time.monotonic() - started < 60, result.describe()


@needs_etcdctl
@pytest.mark.timeout(120)
def test_an_expired_auth_token_is_replaced_for_calls_and_watches(tmp_path):
    for member in start_secure_etcd(tmp_path, "--auth-token-ttl", "1"):
        host, port = member.endpoint.split(":")
        f = member.files
        access = EtcdAccess(
            "https", str(f["ca.pem"]), str(f["client.pem"]), str(f["client.key"]), "rally", "rally-secret"
        )
        store = open_etcd_store([Member(host, int(port))], f"rally/{uuid.uuid4().hex}/", 10, access=access)
        store.set("k", "v")
        first = store.client._auth._token
        time.sleep(3)  # unused for longer than its TTL: etcd forgets the token
        assert store.get_str("k") == "v"
        assert store.client._auth._token not in (None, first), "a fresh token"
        time.sleep(3)
        watcher = store.connect_again()
        threading.Timer(0.5, lambda s=store: s.connect_again().set("later", "1")).start()
        watcher.wait(["later"], 10)  # its read refreshes the token, or the watch does
        assert not store.try_wait(["never"], 0.3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "conf, expected",
    [
        pytest.param(
            "cacert=/nonexistent/ca.pem,protocol=https",
            "cacert=/nonexistent/ca.pem: no such readable file",
            id="missing-ca",
        ),
        pytest.param("cacert={ca}", "needs TLS: add protocol=https", id="tls-without-https"),
        pytest.param("protocol=gopher", "use http or https", id="bad-protocol"),
        pytest.param("username=rally", "needs both a name and a password", id="user-without-password"),
        pytest.param("protocol=https,cacert={ca},ca_cert={other}", "name the same file", id="two-cas"),
    ],
)
def test_bad_etcd_tls_and_user_options_are_one_line_and_exit_2(tmp_path, conf, expected):
    ca, other = tmp_path / "ca.pem", tmp_path / "other.pem"
    ca.write_text("not a certificate\n")
    other.write_text("not a certificate either\n")
    result = rally_fails(
        tmp_path, "--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:2379",
        "--rdzv-id", "x", "--rdzv-conf", conf.format(ca=ca, other=other), "train.py",
    )  # fmt: skip
    line = assert_one_line_only(result)
    assert expected in line, line


@pytest.mark.timeout(60)
def test_etcd_tls_options_with_another_backend_are_one_line(tmp_path):
    for backend in ("c10d", "static"):
        result = rally_fails(
            tmp_path, "--nnodes", "2", "--rdzv-backend", backend, "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "--rdzv-conf", "username=u,password=p", "train.py",
        )  # fmt: skip
        line = assert_one_line_only(result)
        assert "--rdzv-conf username=... applies to --rdzv-backend etcd only" in line, line
