"""The ``tensorcast`` command line: the command group, and the commands that use a cluster (``status``,
``put``, ``get``, ``load``, ``ls``, ``rm``); those that run processes (``up``, ``gs``, ``worker``, ``add-worker``,
``stop-worker``) are ``cli.procs``', ``credential`` is ``cli.credentials``'.

Owns: client flags, how a client command finds the cluster (``--address``, ``TENSORCAST_ADDRESS`` or
``DATA_DIR/cluster.json``; an address that does not answer is reported with where it came from), ``--token`` /
``TENSORCAST_TOKEN``, and human-readable output. Errors print one line and exit 2; no tracebacks for user
mistakes. Reading and writing files is ``cli.files``'s job, the status tables ``cli.status``'.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import numpy as np
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table
from rich.text import Text

from tensorcast.cli.common import console, err_console, say
from tensorcast.cli.credentials import credential
from tensorcast.cli.files import (
    METADATA_SUFFIX,
    PROGRESS_BYTES,
    byte_progress,
    check_suffix,
    checkpoint_files,
    deleted_line,
    download,
    get_metadata,
    output_file,
    put_metadata,
    read_tensors,
    size,
    upload,
    write_tensors,
)
from tensorcast.cli.procs import add_worker, gs, stop_worker, up, worker
from tensorcast.cli.router import router
from tensorcast.errors import InvalidArgument, NotFound, TensorCastError, Unavailable
from tensorcast.pool.placement import PRESETS
from tensorcast.views import TP
from tensorcast.weights.object_store import is_object_url

if TYPE_CHECKING:
    from tensorcast.client.sync import Artifact, Client


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TensorCastError as exc:
            # A Text, not markup: messages hold paths and keys, and "[...]" in them is not a style.
            err_console.print(Text.assemble(("error", "red"), f" {exc}"), soft_wrap=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(package_name="tensorcast")
def main() -> None:
    """TensorCast: a shared, programmable tensor pool for LLM infrastructure."""


main.add_command(gs)
main.add_command(worker)
main.add_command(up)
main.add_command(add_worker)
main.add_command(stop_worker)
main.add_command(credential)
main.add_command(router)


def _address(address: str | None, data_dir: str) -> tuple[str, str]:
    """The cluster's address and where it came from (said when it does not answer)."""
    if address:
        return address, "--address"
    if os.environ.get("TENSORCAST_ADDRESS"):
        return os.environ["TENSORCAST_ADDRESS"], "TENSORCAST_ADDRESS"
    path = Path(data_dir) / "cluster.json"
    if path.exists():
        try:
            return str(json.loads(path.read_text())["address"]), str(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"{path}: not a cluster manifest ({exc!r}); pass --address") from None
    raise InvalidArgument(f"no cluster address: pass --address, set TENSORCAST_ADDRESS, or run `tensorcast up` "
                          f"with --data-dir {data_dir}")


def _client_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--address``, ``--data-dir`` and ``--token``: how every client command finds and joins the cluster."""
    f = click.option("--token", envvar="TENSORCAST_TOKEN", default=None, show_envvar=True,
                     help="Cluster token, when the cluster has one (the variable keeps it out of `ps`).")(f)
    f = click.option("--data-dir", default="./tc-data", show_default=True,
                     help="Where `tensorcast up` wrote cluster.json.")(f)
    return click.option("--address", default=None, help="Gateway HOST:PORT.")(f)


def _client(address: str | None, data_dir: str, token: str | None) -> Client:
    from tensorcast.client.sync import connect

    where, source = _address(address, data_dir)
    try:
        return connect(where, token)
    except Unavailable as exc:
        hint = " (is the cluster that wrote it still running?)" if source.endswith("cluster.json") else ""
        raise Unavailable(f"cannot reach the cluster at {where}, from {source}{hint}: {exc.message}") from None


@main.command()
@click.option("--shards", "show_shards", is_flag=True, help="List every shard lease, not just a summary.")
@click.option("--json", "as_json", is_flag=True, help="Print the dashboard's view (and every metrics URL) as JSON.")
@click.option("--watch", is_flag=True, help="Redraw the dashboard's view in the terminal until interrupted.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="Seconds between redraws with --watch.")
@_client_options
def status(show_shards: bool, as_json: bool, watch: bool, interval: float, address: str | None, data_dir: str,
           token: str | None) -> None:
    """Show the cluster's workers, instances and KV shard leases."""
    from tensorcast.cli.status import cluster_state, instance_table, shard_table, worker_table

    with _client(address, data_dir, token) as client:
        if as_json:
            click.echo(json.dumps(cluster_state(client), indent=2))
            return
        if watch:
            _watch(client, interval)
            return
        console.print(worker_table(client))
        instances = instance_table(client)
        if instances is not None:
            console.print(instances)
        console.print(shard_table(client, show_shards))


def _watch(client: Client, interval: float) -> None:
    """Redraw the view in place on a terminal; elsewhere (a pipe, a file), print one frame per interval. Ctrl-C
    (SIGINT) ends it between two frames: raised as KeyboardInterrupt at any point, it could stop the main thread
    while it holds a lock the client's close then waits for (a logging handler's, say), and the exit would hang."""
    from rich.live import Live

    from tensorcast.cli.status import cluster_state, view_tables

    stop = threading.Event()
    on_main = threading.current_thread() is threading.main_thread()  # where signal handlers can be set
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set()) if on_main else None
    try:
        if not console.is_terminal:
            while not stop.is_set():
                console.print(view_tables(cluster_state(client)))
                console.file.flush()
                stop.wait(interval)
            return
        with Live(view_tables(cluster_state(client)), console=console, auto_refresh=False) as live:
            while not stop.wait(interval):
                live.update(view_tables(cluster_state(client)), refresh=True)
    except KeyboardInterrupt:  # off the main thread, or before the handler was set
        pass
    finally:
        if previous is not None:  # None also for a handler set outside Python: left as it is now
            signal.signal(signal.SIGINT, previous)


def _progress(nbytes: int) -> contextlib.AbstractContextManager[Progress | None]:
    """Byte progress bars on stderr for transfers above ``PROGRESS_BYTES``; nothing for small ones."""
    return byte_progress(err_console) if nbytes > PROGRESS_BYTES else contextlib.nullcontext()


@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("key")
@click.option("--ttl", type=float, default=None, help="Caller lease in seconds (default: system-owned).")
@click.option("--policy", type=click.Choice(list(PRESETS)), default=None,
              help="Placement preset (default: cache).")
@_client_options
def put(file: Path, key: str, ttl: float | None, policy: str | None, address: str | None, data_dir: str,
        token: str | None) -> None:
    """Store a .npy or .safetensors FILE under KEY.

    A safetensors file's __metadata__ is kept as a companion artifact, KEY.__metadata__ (its JSON as one
    uint8 tensor): `get` writes it back, `rm KEY` deletes it. Files over 64 MiB show progress (reading,
    then uploading) on stderr.
    """
    check_suffix(file, "FILE")
    if key.endswith(METADATA_SUFFIX):
        raise InvalidArgument(f"keys ending in {METADATA_SUFFIX} hold safetensors metadata; choose another KEY")
    with _client(address, data_dir, token) as client, _progress(file.stat().st_size) as progress:
        data = read_tensors(file, progress)
        art = upload(client, data.tensors, key, ttl, policy, progress)
        put_metadata(client, key, data.metadata, ttl, policy)
    say(f"{art.id} {key} ({len(art.tensor_names)} tensors, {size(art.nbytes)}"
         + (", with safetensors metadata)" if data.metadata else ")"))


@main.command()
@click.argument("key")
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@_client_options
def get(key: str, out: Path, address: str | None, data_dir: str, token: str | None) -> None:
    """Write artifact KEY to OUT (.npy for one tensor, .safetensors for any).

    A .safetensors OUT gets back the __metadata__ that `put` kept for KEY (in KEY.__metadata__). OUT is
    written under a temporary name and renamed when complete. Artifacts over 64 MiB show download progress
    on stderr.
    """
    check_suffix(out, "OUT")
    metadata = None
    with output_file(out) as part, _client(address, data_dir, token) as client:
        art = client.artifact(key)
        with _progress(art.nbytes) as progress:
            tensors = download(art, progress)
        if out.suffix == ".safetensors":
            metadata = get_metadata(client, key)
        write_tensors(out, part, tensors, metadata)
    say(f"wrote {out} ({size(art.nbytes)}" + (", with safetensors metadata)" if metadata else ")"))


def _parse_tp(tp: str | None) -> TP | None:
    if tp is None:
        return None
    try:
        rank, world = (int(x) for x in tp.split("/"))
    except ValueError:
        raise InvalidArgument(f"--tp expects RANK/WORLD, e.g. 0/2, got {tp!r}") from None
    return TP(rank, world)


@main.command()
@click.argument("path")
@click.argument("key")
@click.option("--warm", "warm_on", default=None, metavar="WORKER",
              help="Also read the weights into WORKER's memory now (the warm path), with progress.")
@click.option("--tp", default=None, metavar="RANK/WORLD", help="With --warm: only this tensor-parallel rank.")
@click.option("--no-verify", is_flag=True, help="Do not refuse reads of files changed after registration.")
@_client_options
def load(path: str, key: str, warm_on: str | None, tp: str | None, no_verify: bool, address: str | None,
         data_dir: str, token: str | None) -> None:
    """Register a safetensors checkpoint PATH under KEY (its bytes are read on use or with --warm). PATH is
    a local file or directory, or s3://BUCKET/PREFIX in an S3-compatible store the worker may read
    (weights.object_prefixes; credentials: the worker's AWS environment, see docs/weights.md).

    Registration reads every file's header (a spinner on stderr says how many files); --warm then shows
    the bytes read into the worker."""
    tp_spec = _parse_tp(tp)
    if is_object_url(path):
        what = f"registering {path}: reading the headers with ranged GETs"
    else:
        if not Path(path).exists():
            raise InvalidArgument(f"{path}: no such file or directory")
        files = checkpoint_files(Path(path))
        what = f"registering {path}: reading the headers of {len(files)} file(s), " \
               f"{size(sum(f.stat().st_size for f in files))}"
    with _client(address, data_dir, token) as client:
        if warm_on is not None:  # checked first: a typo must not leave a half-done job behind
            known = [w.worker_id for w in client.list_workers()]
            if warm_on not in known:
                raise InvalidArgument(f"--warm {warm_on}: no such worker; workers: {', '.join(known) or 'none'}")
        with err_console.status(escape(what)):
            art = client.from_disk(path, key, verify_checksums=not no_verify)
        say(f"{art.id} {key}: {len(art.tensor_names)} tensors, {size(art.nbytes)}, model_type "
             f"{art.info.meta.get('model_type') or '-'} (registered, not read)")
        if warm_on is not None:
            _warm(client, art, warm_on, tp_spec)


def _warm(client: Client, art: Artifact, warm_on: str, tp_spec: TP | None) -> None:
    total = art.nbytes
    if tp_spec is not None:
        view = art.view(tp=tp_spec)
        total = sum(int(np.prod(view.shape(n), dtype=np.int64)) * art.meta(n).nbytes
                    // max(int(np.prod(art.meta(n).shape, dtype=np.int64)), 1) for n in view.tensor_names)
    def used() -> int:  # 0 for a worker that has left meanwhile: the prefetch then says why it failed
        return next((w.memory_used for w in client.list_workers() if w.worker_id == warm_on), 0)

    before = used()
    op = art.prefetch(to=warm_on, tp=tp_spec)
    with byte_progress(err_console) as progress:
        task = progress.add_task(f"reading into {warm_on}", total=total)
        while not op.done():
            # Worker memory use arrives with heartbeats: coarse but real progress.
            now = used()
            progress.update(task, completed=min(max(now - before, 0), total))
            time.sleep(0.2)
        result = op.result()
        progress.update(task, completed=total)
    say(f"warm on {warm_on}: {size(result.bytes_moved)} in {result.seconds:.2f}s"
         + (" (already there)" if result.already_present else ""))


@main.command(name="ls")
@click.argument("prefix", default="")
@_client_options
def ls_cmd(prefix: str, address: str | None, data_dir: str, token: str | None) -> None:
    """List the keys starting with PREFIX, one row each (equal content under two keys: two rows with one id);
    with no PREFIX, also the artifacts no key names ("-"). KEY.__metadata__ rows: safetensors metadata of KEY."""
    with _client(address, data_dir, token) as client:
        table = Table()
        for col in ("key", "id", "tensors", "size", "owner", "replicas", "created"):
            table.add_column(col)
        for a in client.ls(prefix):
            created = datetime.datetime.fromtimestamp(a.info.created_at).strftime("%Y-%m-%d %H:%M:%S")
            table.add_row(escape(a.key or "-"), a.id, str(len(a.tensor_names)), size(a.nbytes),
                          a.owner, ",".join(r.worker_id for r in a.replicas), created)
        console.print(table)


@main.command()
@click.argument("key_or_id")
@_client_options
def rm(key_or_id: str, address: str | None, data_dir: str, token: str | None) -> None:
    """Delete a key (its bytes go when no other key or lease names them) and the safetensors metadata `put`
    kept for that key; or, given an artifact id, the content with every key naming it."""
    with _client(address, data_dir, token) as client:
        say(deleted_line(key_or_id, client.delete(key_or_id)))
        with contextlib.suppress(NotFound):
            say(deleted_line(key_or_id + METADATA_SUFFIX, client.delete(key_or_id + METADATA_SUFFIX)))
