"""Model repositories in object stores: ``s3://``, ``gs://`` and ``as://`` (Azure), named as Triton
names them, read through fsspec (s3fs, gcsfs, adlfs: the optional extras ``shmserve[s3]``,
``shmserve[gcs]``, ``shmserve[azure]``).

The broker never reads a bucket: it serves a local copy, exactly as it serves a local repository.
Each cloud repository gets a private folder under the system's temporary directory (``$TMPDIR``),
``shmserve-repository.<server id>.<random>``, holding

- ``repository/``: the copy the broker loads from (what ``--model-repository`` becomes),
- ``manifest.json``: each copied object's tag (its ETag with its size, or its modification time
  where the store gives no ETag), so a re-sync downloads only what changed,
- ``staging/``: downloads in progress, outside the watched copy,
- ``owner``: the launcher's pid, so a folder left by a killed server is removed at the next start
  under the same id.

A sync downloads a model folder's changed objects to ``staging/`` first and then moves them into
place in one burst, with the files the store no longer holds removed in the same burst: poll mode's
watcher (which waits for a folder to be quiet) never sees half a model. The launcher's process makes
the copies and removes them at exit (``make_copies``, ``remove_copies``); the broker re-syncs them
(cloud_sync.py).

Credentials are Triton's: ``TRITON_CLOUD_CREDENTIAL_PATH`` (a JSON file, the longest key that starts
the URL wins), else each store's own environment variables, read by its SDK as Triton reads them
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``,
then ``~/.aws``; ``GOOGLE_APPLICATION_CREDENTIALS``; ``AZURE_STORAGE_KEY`` for the account the URL
names).
"""
from __future__ import annotations

import dataclasses
import glob
import importlib
import json
import logging
import os
import shutil
import tempfile
import threading
from typing import Any, Iterable, Mapping

from shmserve.shm.names import pid_alive

log = logging.getLogger("shmserve")

# scheme -> (the fsspec package that reads it, the extra that installs that package)
SCHEMES = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "as": ("adlfs", "azure")}
# Where Triton puts its copy when told; here the copy's place follows $TMPDIR (a warning says so).
MOUNT_VARIABLES = {"s3": "TRITON_AWS_MOUNT_DIRECTORY", "gs": "TRITON_GCS_MOUNT_DIRECTORY",
                   "as": "TRITON_AZURE_MOUNT_DIRECTORY"}
FOLDER_PREFIX = "shmserve-repository."


class CloudError(Exception):
    """Why a cloud repository cannot be read, in one line."""


def is_cloud(path: str) -> bool:
    """A URL rather than a local folder (an unknown scheme is refused by ``parse``)."""
    return "://" in path


@dataclasses.dataclass(frozen=True)
class Location:
    url: str  # as given
    scheme: str  # s3, gs or as
    bucket: str  # the bucket (Azure: the container)
    path: str  # the repository's folder in the bucket, without surrounding slashes ('' for the top)
    endpoint: str = ""  # s3 only: 'http(s)://host:port' of an S3-compatible store (MinIO, ...)
    account: str = ""  # as only: the storage account

    @property
    def root(self) -> str:
        """The repository as fsspec names it: 'bucket/path'."""
        return f"{self.bucket}/{self.path}" if self.path else self.bucket


def parse(url: str) -> Location:
    """``s3://bucket/path``, ``s3://[http://|https://]host:port/bucket/path``, ``gs://bucket/path``,
    ``as://account/container/path``; CloudError says what is wrong."""
    scheme, _, rest = url.partition("://")
    if scheme not in SCHEMES:
        raise CloudError(f"model repository '{url}': unknown scheme '{scheme}://' "
                         f"(s3://, gs:// and as:// are read; anything else must be a local folder)")
    endpoint = account = ""
    if scheme == "s3":
        protocol = ""
        for given in ("http://", "https://"):
            if rest.startswith(given):
                protocol, rest = given, rest[len(given):]
        host, _, tail = rest.partition("/")
        if protocol or ":" in host:  # bucket names hold no ':', so 'host:port' names an endpoint (HTTP by default)
            endpoint, rest = f"{protocol or 'http://'}{host}", tail
            if not host:
                raise CloudError(f"model repository '{url}': no host before the bucket")
    elif scheme == "as":
        account, _, rest = rest.partition("/")
        if not account:
            raise CloudError(f"model repository '{url}': no storage account (as://account/container/path)")
    bucket, _, path = rest.partition("/")
    if not bucket:
        raise CloudError(f"model repository '{url}': no {'container' if scheme == 'as' else 'bucket'}")
    return Location(url, scheme, bucket, path.strip("/"), endpoint, account)


def _credential_entry(loc: Location, environ: Mapping[str, str]) -> Any:
    """The entry of ``TRITON_CLOUD_CREDENTIAL_PATH`` for ``loc``: the longest key that starts its
    URL ('' matches all); None without the file or a matching key."""
    path = environ.get("TRITON_CLOUD_CREDENTIAL_PATH")
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            section = json.load(f).get(loc.scheme) or {}
    except (OSError, ValueError, AttributeError) as e:
        raise CloudError(f"TRITON_CLOUD_CREDENTIAL_PATH '{path}' cannot be read: {e}") from None
    keys = [k for k in section if loc.url.startswith(k)]
    return section[max(keys, key=len)] if keys else None


def storage_options(loc: Location, environ: Mapping[str, str]) -> dict[str, Any]:
    """The fsspec file system's arguments for ``loc``: its endpoint and the credentials that are
    not left to the store's SDK (those of the credential file, Azure's key)."""
    entry = _credential_entry(loc, environ)
    if loc.scheme == "s3":
        opts: dict[str, Any] = {"endpoint_url": loc.endpoint} if loc.endpoint else {}
        if isinstance(entry, dict):
            for ours, theirs in (("key", "key_id"), ("secret", "secret_key"), ("token", "session_token"),
                                 ("profile", "profile")):
                if entry.get(theirs):
                    opts[ours] = entry[theirs]
            if entry.get("region"):
                opts["client_kwargs"] = {"region_name": entry["region"]}
        return opts
    if loc.scheme == "gs":
        # Triton's order: the credential file, GOOGLE_APPLICATION_CREDENTIALS, then what gcsfs finds
        # (the attached service account, else anonymous). With STORAGE_EMULATOR_HOST (a local
        # emulator, which gcsfs then talks to) anonymous, as Google's own clients do.
        token = entry or environ.get("GOOGLE_APPLICATION_CREDENTIALS") or None
        if token is not None and not os.path.isfile(token):
            raise CloudError(f"model repository '{loc.url}': the Google credential file '{token}' does not exist")
        if token is None and environ.get("STORAGE_EMULATOR_HOST"):
            token = "anon"
        return {"token": token}
    account, key = loc.account, environ.get("AZURE_STORAGE_KEY")
    if isinstance(entry, dict):
        account, key = entry.get("account_str") or account, entry.get("account_key") or key
    return {"account_name": account, **({"account_key": key} if key else {})}


def filesystem(loc: Location, environ: Mapping[str, str]) -> Any:
    """An fsspec file system for ``loc`` that caches no listing (every sync must see the store as
    it is now); CloudError names the extra to install when its package is missing."""
    package, extra = SCHEMES[loc.scheme]
    for sdk in ("botocore", "aiobotocore", "s3fs", "gcsfs", "google", "azure", "adlfs"):
        logging.getLogger(sdk).setLevel(logging.WARNING)  # their INFO lines (credentials found, ...) are noise here
    try:
        module = importlib.import_module(package)
    except ImportError:
        raise CloudError(f"model repository '{loc.url}' needs the {package} package: "
                         f"pip install 'shmserve[{extra}]'") from None
    opts = storage_options(loc, environ)
    if loc.scheme == "s3":
        cls = module.S3FileSystem
    elif loc.scheme == "gs":
        # The plain file system: gcsfs's default class first probes the bucket's layout over gRPC
        # (for features a read-only copy never needs), which an emulator cannot answer.
        cls = importlib.import_module("gcsfs.core").GCSFileSystem
    else:
        cls = module.AzureBlobFileSystem
    return cls(skip_instance_cache=True, use_listings_cache=False, **opts)


def _tag(info: Mapping[str, Any]) -> str:
    """What changes when an object changes: its ETag (or MD5), else its modification time; with its size."""
    tag = info.get("ETag") or info.get("etag") or info.get("md5Hash")
    if not tag:
        tag = info.get("LastModified") or info.get("last_modified") or info.get("updated") or info.get("mtime")
    return f"{tag}|{info.get('size')}"


def _one_line(e: BaseException) -> str:
    """The first line of an SDK's error, named by its kind where the SDK's text is terse (gcsfs says
    only 'b/<bucket>/o' for a missing bucket)."""
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else type(e).__name__
    if isinstance(e, FileNotFoundError):
        return f"not found ({text})"
    if isinstance(e, PermissionError):
        return f"access denied ({text})"
    return text


class Mirror:
    """One cloud repository's local copy (the folder layout is in the module's docstring)."""

    def __init__(self, url: str, folder: str) -> None:
        self.location = parse(url)
        self.folder = folder
        self.repository = os.path.join(folder, "repository")
        self._staging = os.path.join(folder, "staging")
        self._manifest = os.path.join(folder, "manifest.json")
        self._fs: Any = None
        self._lock = threading.Lock()  # one sync at a time: they share the manifest and staging/

    def sync(self, model: str | None = None) -> set[str]:
        """Make the copy of ``model``'s folder (None: of everything) equal to the store's objects;
        returns the names of the model folders that changed. CloudError says why it could not."""
        with self._lock:
            try:
                return self._sync(model)
            except CloudError:
                raise
            except Exception as e:  # noqa: BLE001 - the SDKs' errors share no base class; each becomes one line
                raise CloudError(f"cannot read model repository '{self.location.url}': {_one_line(e)}") from None

    def _sync(self, model: str | None) -> set[str]:
        if self._fs is None:
            self._fs = filesystem(self.location, os.environ)
        root = self.location.root
        remote = self._list(f"{root}/{model}" if model else root, root, model)
        try:
            with open(self._manifest, encoding="utf-8") as f:
                manifest: dict[str, str] = json.load(f)
        except FileNotFoundError:
            manifest = {}
        fetch: dict[str, list[str]] = {}  # per model folder: what to download, what to remove
        gone: dict[str, list[str]] = {}
        for rel, tag in remote.items():
            if manifest.get(rel) != tag or not os.path.isfile(self._local(rel)):
                fetch.setdefault(_model_of(rel), []).append(rel)
        for rel in manifest:
            if rel not in remote and (model is None or _model_of(rel) == model):
                gone.setdefault(_model_of(rel), []).append(rel)
        changed = fetch.keys() | gone.keys()
        for name in sorted(changed):  # a model at a time: downloads first, then one burst of moves
            self._apply(name, fetch.get(name, []), gone.get(name, []))
            for rel in gone.get(name, []):
                del manifest[rel]
            manifest.update((rel, remote[rel]) for rel in fetch.get(name, []))
            self._save(manifest)  # what is in place now, should the next model's download fail
        if not os.path.exists(self._manifest):
            self._save(manifest)
        return changed

    def _save(self, manifest: dict[str, str]) -> None:
        tmp = self._manifest + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(manifest, f)
        os.replace(tmp, self._manifest)

    def _list(self, base: str, root: str, model: str | None) -> dict[str, str]:
        """{path in the repository: tag} of every object under ``base``. Keys that would leave the
        copy ('..', empty parts) and folder markers are skipped."""
        self._fs.invalidate_cache()
        out = {}
        for path, info in self._fs.find(base, detail=True).items():
            rel = path[len(root) + 1:] if path.startswith(root + "/") else ""
            parts = rel.split("/")
            if info.get("type") != "file" or any(p in ("", ".", "..") for p in parts):
                continue
            if model is None or parts[0] == model:  # 'm' asked for: not what a 'm...' prefix matched too
                out[rel] = _tag(info)
        return out

    def _local(self, rel: str) -> str:
        return os.path.join(self.repository, *rel.split("/"))

    def _apply(self, model: str, fetch: list[str], gone: list[str]) -> None:
        root = self.location.root
        staged = []
        os.makedirs(self._staging, exist_ok=True)
        for i, rel in enumerate(fetch):
            tmp = os.path.join(self._staging, str(i))
            self._fs.get_file(f"{root}/{rel}", tmp)
            staged.append((tmp, self._local(rel)))
        for tmp, dest in staged:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            os.replace(tmp, dest)
        for rel in gone:
            try:
                os.unlink(self._local(rel))
            except FileNotFoundError:
                pass
        _prune(os.path.join(self.repository, model))
        log.info("model repository '%s': '%s' synced (%d object(s) copied, %d removed)",
                 self.location.url, model, len(fetch), len(gone))


def _model_of(rel: str) -> str:
    """The model folder a path in the repository belongs to."""
    return rel.split("/", 1)[0]


def _prune(folder: str) -> None:
    """Remove the folders under ``folder`` (and it) that no file is left in: a version the store
    no longer holds must not stay as an empty version folder. The bytecode the Python backend
    wrote there (``__pycache__``) is no file of the store's: it goes with its folder."""
    if not os.path.isdir(folder):
        return
    for path, _, _ in os.walk(folder, topdown=False):
        entries = os.listdir(path)
        if all(e == "__pycache__" for e in entries):
            for e in entries:
                shutil.rmtree(os.path.join(path, e), ignore_errors=True)
            os.rmdir(path)


def _remove_stale(server_id: str) -> None:
    """Folders of an earlier server under this id whose launcher is gone (killed before its exit)."""
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), f"{FOLDER_PREFIX}{server_id}.*")):
        try:
            if os.stat(folder).st_uid != os.getuid():
                continue
            with open(os.path.join(folder, "owner"), encoding="ascii") as f:
                pid = int(f.read().strip() or 0)
        except (OSError, ValueError):
            pid = 0
        if not pid_alive(pid):
            shutil.rmtree(folder, ignore_errors=True)
            log.warning("removed the copy of a cloud model repository left by a previous server: %s", folder)


def make_copies(repositories: Iterable[str], server_id: str) -> dict[str, str]:
    """Copy every cloud repository among ``repositories`` to a new folder; returns {URL: its local
    repository folder}. On a CloudError nothing is left behind."""
    _remove_stale(server_id)
    copies: dict[str, str] = {}
    try:
        for url in repositories:
            if not is_cloud(url) or url in copies:
                continue
            mount = MOUNT_VARIABLES[parse(url).scheme]  # a bad URL fails before a folder is made
            if os.environ.get(mount):
                log.warning("%s is not read: the copy of '%s' goes under %s (set TMPDIR to move it)", mount, url,
                            tempfile.gettempdir())
            folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{server_id}.")
            copies[url] = os.path.join(folder, "repository")
            with open(os.path.join(folder, "owner"), "w", encoding="ascii") as f:
                f.write(str(os.getpid()))
            mirror = Mirror(url, folder)
            os.makedirs(mirror.repository)
            if not mirror.sync():
                log.warning("model repository '%s' holds no objects yet", url)
            log.info("model repository '%s' is served from its copy in '%s'", url, mirror.repository)
    except BaseException:
        remove_copies(copies.values())
        raise
    return copies


def remove_copies(repositories: Iterable[str]) -> None:
    """Remove the folders ``make_copies`` made (given by their repository folders)."""
    for repository in repositories:
        shutil.rmtree(os.path.dirname(repository), ignore_errors=True)
