"""Cloud model repositories against real object-store servers on loopback: S3 through moto's server
mode (with its IAM authentication on, so wrong keys are refused) and GCS through
gcp-storage-emulator. Azure (as://) has no server installable from PyPI: its URL, its credentials
and its missing-extra error are checked without one.

Each test copies model_repository/add_sub into a bucket of its own, starts a real shmserve on it,
and changes the bucket while it serves."""
from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import DEADLINE_S, PYTHON, ROOT, ServerFactory, free_port, free_ports, new_server_id, wait_until
from shmserve.server.broker.cloud_repository import CloudError, Mirror, parse, storage_options

ADD_SUB = ROOT / "model_repository" / "add_sub"
ALL_VERSIONS = 'version_policy: { all { } }\n'


def _wait_port(port: int, proc: subprocess.Popen) -> None:
    def listening() -> bool:
        assert proc.poll() is None, "the object-store server exited at start"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    wait_until(listening, f"an object-store server listening on port {port}")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class S3:
    """moto's S3 server, with IAM authentication: only the access key made here is accepted."""

    def __init__(self) -> None:
        import boto3

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        # The first three requests (the user, its policy, its key) need no signature; all others do.
        env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="3")
        self.proc = subprocess.Popen([PYTHON, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, self.proc)
        iam = boto3.client("iam", endpoint_url=self.endpoint, region_name="us-east-1",
                           aws_access_key_id="none", aws_secret_access_key="none")
        iam.create_user(UserName="shmserve")
        iam.put_user_policy(UserName="shmserve", PolicyName="s3", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="shmserve")["AccessKey"]
        self.key_id, self.secret = key["AccessKeyId"], key["SecretAccessKey"]
        self.client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                                   aws_access_key_id=self.key_id, aws_secret_access_key=self.secret)

    def bucket(self, name: str) -> str:
        self.client.create_bucket(Bucket=name)
        return name

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=bucket, Key=key, Body=data)

    def upload(self, folder: Path, bucket: str, prefix: str) -> None:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                self.put(bucket, f"{prefix}/{path.relative_to(folder).as_posix()}", path.read_bytes())

    def delete_prefix(self, bucket: str, prefix: str) -> None:
        for obj in self.client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", []):
            self.client.delete_object(Bucket=bucket, Key=obj["Key"])


@pytest.fixture(scope="module")
def s3() -> Iterator[S3]:
    server = S3()
    yield server
    _stop(server.proc)


@pytest.fixture
def aws_env(s3: S3, monkeypatch) -> S3:
    """Triton's S3 variables with the valid key; nothing else that could choose other credentials."""
    for name in ("TRITON_CLOUD_CREDENTIAL_PATH", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL",
                 "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return s3


def copies_of(server_id: str) -> list[str]:
    """The local copies a server with this id has under the temporary directory."""
    return glob.glob(os.path.join(tempfile.gettempdir(), f"shmserve-repository.{server_id}.*"))


def add_sub(client: httpclient.InferenceServerClient, version: str = "") -> tuple[list[int], list[int]]:
    a, b = np.arange(16, dtype=np.int32), np.full(16, 3, dtype=np.int32)
    inputs = []
    for name, value in (("INPUT0", a), ("INPUT1", b)):
        t = httpclient.InferInput(name, [16], "INT32")
        t.set_data_from_numpy(value)
        inputs.append(t)
    result = client.infer("add_sub", inputs, model_version=version)
    return result.as_numpy("OUTPUT0").tolist(), result.as_numpy("OUTPUT1").tolist()


EXPECTED = ([i + 3 for i in range(16)], [i - 3 for i in range(16)])


def versions(client: httpclient.InferenceServerClient, model: str = "add_sub") -> list[str]:
    try:
        return client.get_model_metadata(model)["versions"]
    except InferenceServerException:
        return []


def serve_from_bucket(s3: S3, factory: ServerFactory, bucket: str, flags: list[str] | None = None,
                      url: str = "", server_id: str | None = None):
    """add_sub copied to ``repo/`` in a new bucket, and a server started on it (by default from
    Triton's ``s3://host:port/bucket/path``, HTTP)."""
    s3.upload(ADD_SUB, s3.bucket(bucket), "repo/add_sub")
    return factory.start([url or f"s3://127.0.0.1:{s3.port}/{bucket}/repo"], flags or [], server_id=server_id)


def start_fails(repo: str, *flags: str) -> tuple[int, list[str], str]:
    """Run shmserve on ``repo``, which must fail at start: (exit code, stderr lines, server id)."""
    sid = new_server_id()
    http, grpc, metrics = free_ports(3)
    r = subprocess.run([PYTHON, "-m", "shmserve", "--model-repository", repo, "--id", sid,
                        "--http-address", "127.0.0.1", "--http-port", str(http), "--grpc-address", "127.0.0.1",
                        "--grpc-port", str(grpc), "--metrics-port", str(metrics), *flags],
                       cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=DEADLINE_S)
    return r.returncode, r.stderr.strip().splitlines(), sid


# -- S3 ------------------------------------------------------------------------------------------


def test_serves_a_model_from_s3_and_removes_its_copy_at_exit(aws_env: S3, server_factory):
    server = serve_from_bucket(aws_env, server_factory, "serve")
    assert add_sub(server.client()) == EXPECTED
    [folder] = copies_of(server.id)
    assert sorted(os.listdir(os.path.join(folder, "repository", "add_sub"))) == ["1", "config.pbtxt"]
    assert server.stop() == 0
    assert copies_of(server.id) == []


def test_poll_mode_loads_a_new_version_and_a_changed_config_from_the_bucket(aws_env: S3, server_factory):
    bucket = "poll"
    server = serve_from_bucket(aws_env, server_factory, bucket, ["--model-control-mode=poll", "--repository-poll-secs=1"],
                               url=f"s3://http://127.0.0.1:{aws_env.port}/{bucket}/repo")  # the endpoint's protocol named
    client = server.client()
    assert versions(client) == ["1"]

    aws_env.upload(ADD_SUB / "1", bucket, "repo/add_sub/2")  # a new version, while serving
    wait_until(lambda: versions(client) == ["2"], "serving version 2")
    assert add_sub(client) == EXPECTED

    config = (ADD_SUB / "config.pbtxt").read_text() + ALL_VERSIONS  # every version, not the latest only
    aws_env.put(bucket, "repo/add_sub/config.pbtxt", config.encode())
    wait_until(lambda: versions(client) == ["1", "2"], "serving versions 1 and 2")
    assert add_sub(client, "1") == add_sub(client, "2") == EXPECTED

    aws_env.delete_prefix(bucket, "repo/add_sub/2")  # a version gone from the bucket is unloaded
    wait_until(lambda: versions(client) == ["1"], "serving version 1 only")

    aws_env.delete_prefix(bucket, "repo/add_sub")  # and a model gone is unloaded
    wait_until(lambda: not client.is_model_ready("add_sub"), "unloading add_sub")


def test_explicit_load_syncs_the_model_from_the_bucket_first(aws_env: S3, server_factory):
    bucket = "explicit"
    server = serve_from_bucket(aws_env, server_factory, bucket, ["--model-control-mode=explicit", "--load-model=add_sub"])
    client = server.client()
    assert versions(client) == ["1"]

    aws_env.upload(ADD_SUB / "1", bucket, "repo/add_sub/2")
    client.load_model("add_sub")  # answered once the load of what the bucket holds now is over
    assert versions(client) == ["2"]
    assert add_sub(client) == EXPECTED

    # A model the copy never held: the load finds it in the bucket.
    config = (ADD_SUB / "config.pbtxt").read_text().replace('name: "add_sub"', 'name: "adder"')
    aws_env.put(bucket, "repo/adder/config.pbtxt", config.encode())
    aws_env.put(bucket, "repo/adder/3/model.py", (ADD_SUB / "1" / "model.py").read_bytes())
    client.load_model("adder")
    assert versions(client, "adder") == ["3"]

    with pytest.raises(InferenceServerException, match="failed to poll from model repository"):
        client.load_model("not_in_the_bucket")
    client.unload_model("adder")
    wait_until(lambda: not client.is_model_ready("adder"), "unloading adder")


def test_a_missing_bucket_fails_at_start_in_one_line(aws_env: S3):
    code, lines, sid = start_fails(f"s3://127.0.0.1:{aws_env.port}/no-such-bucket/repo")
    assert code == 1
    assert lines == [f"shmserve: error: cannot read model repository 's3://127.0.0.1:{aws_env.port}/no-such-bucket/"
                     f"repo': not found (The specified bucket does not exist)"]
    assert copies_of(sid) == []


@pytest.mark.parametrize("variable,value,says", [
    ("AWS_SECRET_ACCESS_KEY", "wrong", "signature we calculated does not match"),
    ("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0", "Access Key Id you provided does not exist"),
])
def test_bad_credentials_fail_at_start_in_one_line(aws_env: S3, monkeypatch, variable, value, says):
    bucket = aws_env.bucket("credentials")
    monkeypatch.setenv(variable, value)
    code, lines, sid = start_fails(f"s3://127.0.0.1:{aws_env.port}/{bucket}/repo")
    assert code == 1
    assert len(lines) == 1 and lines[0].startswith("shmserve: error: cannot read model repository"), lines
    assert "access denied" in lines[0] and says in lines[0]
    assert copies_of(sid) == []


def test_the_credential_file_wins_over_the_environment(aws_env: S3, monkeypatch, tmp_path, server_factory):
    """TRITON_CLOUD_CREDENTIAL_PATH: the longest key that starts the URL is used."""
    bucket = "credential-file"
    creds = tmp_path / "cloud_credential.json"
    creds.write_text(json.dumps({"s3": {
        "": {"key_id": "AKIAWRONGWRONGWRONG0", "secret_key": "wrong", "region": "us-east-1"},
        f"s3://http://127.0.0.1:{aws_env.port}/{bucket}": {"key_id": aws_env.key_id, "secret_key": aws_env.secret,
                                                             "region": "us-east-1", "session_token": "", "profile": ""},
    }}))
    monkeypatch.setenv("TRITON_CLOUD_CREDENTIAL_PATH", str(creds))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    server = serve_from_bucket(aws_env, server_factory, bucket, url=f"s3://http://127.0.0.1:{aws_env.port}/{bucket}/repo")
    assert add_sub(server.client()) == EXPECTED


def test_a_copy_left_by_a_killed_server_is_removed_at_the_next_start(aws_env: S3, server_factory):
    sid = new_server_id()
    dead = subprocess.Popen([PYTHON, "-c", "pass"])
    dead.wait()
    stale = Path(tempfile.mkdtemp(prefix=f"shmserve-repository.{sid}."))
    (stale / "owner").write_text(str(dead.pid))
    server = serve_from_bucket(aws_env, server_factory, "stale", server_id=sid)
    assert not stale.exists()
    assert len(copies_of(sid)) == 1
    assert add_sub(server.client()) == EXPECTED


# -- GCS -----------------------------------------------------------------------------------------


@pytest.fixture
def gcs(monkeypatch) -> Iterator[object]:
    """gcp-storage-emulator on loopback, reached through STORAGE_EMULATOR_HOST (as Google's clients)."""
    port = free_port()
    proc = subprocess.Popen([PYTHON, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port),
                             "--in-memory"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port, proc)
        for name in ("TRITON_CLOUD_CREDENTIAL_PATH", "GOOGLE_APPLICATION_CREDENTIALS"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
        import gcsfs.core

        yield gcsfs.core.GCSFileSystem(token="anon", skip_instance_cache=True)
    finally:
        _stop(proc)


def test_serves_a_model_from_gcs_and_follows_it_in_poll_mode(gcs, server_factory):
    gcs.mkdir("models")
    gcs.put(str(ADD_SUB / "config.pbtxt"), "models/repo/add_sub/config.pbtxt")
    gcs.put(str(ADD_SUB / "1" / "model.py"), "models/repo/add_sub/1/model.py")
    server = server_factory.start(["gs://models/repo"], ["--model-control-mode=poll", "--repository-poll-secs=1"])
    client = server.client()
    assert add_sub(client) == EXPECTED
    gcs.put(str(ADD_SUB / "1" / "model.py"), "models/repo/add_sub/2/model.py")
    wait_until(lambda: versions(client) == ["2"], "serving version 2")
    assert server.stop() == 0
    assert copies_of(server.id) == []


def test_a_missing_gcs_bucket_or_credential_file_fails_at_start_in_one_line(gcs, monkeypatch):
    code, lines, _ = start_fails("gs://no-such-bucket/repo")
    assert (code, lines) == (1, ["shmserve: error: cannot read model repository 'gs://no-such-bucket/repo': "
                                 "not found (b/no-such-bucket/o)"])
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/nonexistent/key.json")
    code, lines, _ = start_fails("gs://models/repo")
    assert (code, lines) == (1, ["shmserve: error: model repository 'gs://models/repo': the Google credential file "
                                 "'/nonexistent/key.json' does not exist"])


# -- Azure, URLs, flags --------------------------------------------------------------------------


def test_azure_without_adlfs_names_the_extra_to_install(tmp_path, monkeypatch):
    """adlfs is not in the dev extra; a package that refuses to import stands for its absence."""
    (tmp_path / "adlfs").mkdir()
    (tmp_path / "adlfs" / "__init__.py").write_text("raise ImportError('adlfs is not installed')\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    code, lines, _ = start_fails("as://account/container/repo")
    assert (code, lines) == (1, ["shmserve: error: model repository 'as://account/container/repo' needs the adlfs "
                                 "package: pip install 'shmserve[azure]'"])


def test_azure_credentials_come_from_triton_s_variables_or_the_credential_file(tmp_path):
    loc = parse("as://account/container/path/to/repo")
    assert (loc.account, loc.bucket, loc.path, loc.root) == ("account", "container", "path/to/repo",
                                                              "container/path/to/repo")
    assert storage_options(loc, {"AZURE_STORAGE_ACCOUNT": "account", "AZURE_STORAGE_KEY": "a2V5"}) == \
        {"account_name": "account", "account_key": "a2V5"}
    creds = tmp_path / "creds.json"
    creds.write_text(json.dumps({"as": {"as://account/container": {"account_str": "other", "account_key": "b3RoZXI="}}}))
    assert storage_options(loc, {"TRITON_CLOUD_CREDENTIAL_PATH": str(creds), "AZURE_STORAGE_KEY": "a2V5"}) == \
        {"account_name": "other", "account_key": "b3RoZXI="}


@pytest.mark.parametrize("url,fields", [
    ("s3://bucket/path/to/repo", ("s3", "", "bucket", "path/to/repo")),
    ("s3://bucket", ("s3", "", "bucket", "")),
    ("s3://minio.local:9000/bucket/repo/", ("s3", "http://minio.local:9000", "bucket", "repo")),
    ("s3://http://10.0.0.1:9000/bucket/repo", ("s3", "http://10.0.0.1:9000", "bucket", "repo")),
    ("s3://https://s3.example.com:443/bucket/a/b", ("s3", "https://s3.example.com:443", "bucket", "a/b")),
    ("gs://bucket/repo", ("gs", "", "bucket", "repo")),
])
def test_urls_as_triton_writes_them(url, fields):
    loc = parse(url)
    assert (loc.scheme, loc.endpoint, loc.bucket, loc.path) == fields


def test_bad_urls_and_flags_are_refused_before_anything_starts():
    code, lines, _ = start_fails("ftp://host/repo")
    assert code == 2 and len(lines) == 1 and "unknown scheme 'ftp://'" in lines[0]
    code, lines, _ = start_fails("s3://")
    assert (code, lines) == (2, ["shmserve: error: model repository 's3://': no bucket"])
    code, lines, _ = start_fails("s3://bucket/repo", "--model-control-mode=poll", "--repository-poll-secs=0")
    assert code == 2 and len(lines) == 1 and "--repository-poll-secs must be more than 0" in lines[0]


def test_a_sync_copies_only_what_changed(aws_env: S3, tmp_path):
    """The tags in manifest.json (ETag and size) keep an unchanged object from being downloaded
    again: its local file stays the same inode."""
    bucket = aws_env.bucket("tags")
    aws_env.upload(ADD_SUB, bucket, "repo/add_sub")
    mirror = Mirror(f"s3://127.0.0.1:{aws_env.port}/{bucket}/repo", str(tmp_path))
    assert mirror.sync() == {"add_sub"}
    model_py = tmp_path / "repository" / "add_sub" / "1" / "model.py"
    inode = model_py.stat().st_ino
    assert mirror.sync() == set()
    aws_env.put(bucket, "repo/add_sub/config.pbtxt", (ADD_SUB / "config.pbtxt").read_bytes() + b"\n")
    assert mirror.sync("add_sub") == {"add_sub"}
    assert model_py.stat().st_ino == inode
    with pytest.raises(CloudError, match="not found"):
        Mirror(f"s3://127.0.0.1:{aws_env.port}/missing/repo", str(tmp_path / "other")).sync()
