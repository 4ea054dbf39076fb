"""``output=s3://bucket/folder``: the dataset is written into a local staging directory, where
every local guarantee holds (the output lock, resume after a crash, shards under final names
only when whole), then published to the store by :func:`launcher.core.remote_data.publish`:
the shard files, then ``data.yaml`` with the prefixes on the store, then ``manifest.json``
LAST. A reader takes a folder as a dataset only once its manifest is there, so a run killed
during the upload leaves nothing that training would read; re-running the same command
resumes from the staging directory and uploads again.

``python -m data_prep.upload <output dir> s3://bucket/folder`` publishes an output that exists
already (a merged Slurm array's, whose tasks write into one shared directory) the same way.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import yaml

from data_prep.data_config import DATA_CONFIG, write_data_config
from data_prep.errors import ConfigError, DataPrepError
from launcher.core.diskspace import human_bytes
from launcher.core.objectstore import ObjectURI, StoreFailure, is_remote
from launcher.core.remote_data import (DataUnavailable, check_writable, entry_files, publish,
                                       shard_prefixes)
from launcher.core.shard_cache import TransferProgress, cache_root

RETRY_S = 300.0
"""Seconds each upload request keeps retrying transient failures."""


class UploadFailed(DataPrepError):
    """The store kept failing during the upload (exit 1): nothing is committed; re-run the same
    command to upload again."""


def staged(cfg) -> Optional[ObjectURI]:
    """For ``output=s3://...``: its folder, with ``cfg.output`` replaced by the staging directory
    and ``cfg.name`` defaulting to the folder's last part; the store's write access is checked
    (not by a dry run, which writes nothing). None for a local output. ConfigError (exit 2) for
    an output that cannot be published."""
    if not is_remote(cfg.output):
        return None
    from data_prep.plan import task_layout

    folder = staged_uri(cfg.output)
    if task_layout(cfg.num_tasks, cfg.task_index)[0] > 1:
        raise ConfigError(f"output={cfg.output} with array tasks: the tasks write into one shared "
                          "directory; give that as output=, merge (python -m data_prep.merge), "
                          f"then python -m data_prep.upload <it> {cfg.output}")
    cfg.name = cfg.name or folder.prefix.rpartition("/")[2]
    cfg.output = cfg.staging_dir or str(cache_root() / "data_prep" / folder.bucket / folder.prefix)
    if not cfg.dry_run:
        _check(lambda: check_writable(folder))
    return folder


def publish_output(local_dir: str, folder: ObjectURI, replace: bool,
                   split: Optional[str] = None) -> None:
    """Rewrite the local data config with the prefixes on the store (and ``split``, when
    given), then publish (shards, data.yaml, the manifest last); a line on stdout says what
    was committed."""
    import json

    local = Path(local_dir)
    manifest = json.loads((local / "manifest.json").read_text())
    config = yaml.safe_load((local / DATA_CONFIG).read_text())
    config.update(prefixes=shard_prefixes(folder, manifest), split=split or config["split"])
    write_data_config(str(local), config)
    total = sum(f.bytes for entry in manifest["shards"] for f in entry_files(entry))
    print(f"data_prep: uploading {len(manifest['shards'])} shard(s) ({human_bytes(total)}) from "
          f"{local} to {folder}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    with TransferProgress(total, True, "data_prep: uploading") as bar:
        result = _check(lambda: publish(local, folder, RETRY_S, replace=replace,
                                        data_config=(local / DATA_CONFIG).read_text(),
                                        on_file=lambda name, size: bar.advance(size)))
    print(f"{result}: {folder} ({len(manifest['shards'])} shard(s), {folder}/manifest.json "
          f"written last, {time.perf_counter() - started:.1f} s); train with "
          f"hydra.searchpath=[file://{local}/conf] data={config['name']}", flush=True)


def _check(call):
    """``call()``, store errors as data_prep errors: exit 2 for an unusable store or dataset,
    exit 1 for a store that kept failing mid-upload."""
    try:
        return call()
    except DataUnavailable as exc:
        raise ConfigError(str(exc)) from None
    except StoreFailure as exc:
        raise UploadFailed(f"{exc}; nothing new is committed: re-run the same command to "
                           "upload again") from None


def main(argv=None) -> int:
    """``python -m data_prep.upload <output dir> <s3://bucket/folder> [--split S]
    [--overwrite]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m data_prep.upload",
                                     description="publish a complete data_prep output to object "
                                                 "storage (the manifest last)")
    parser.add_argument("output", help="a complete data_prep output directory (manifest.json)")
    parser.add_argument("uri", help="s3://bucket/folder to publish it under")
    parser.add_argument("--split", default=None,
                        help="train,valid,test split for data.yaml (default: the output's own)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a committed dataset of other inputs or settings there")
    args = parser.parse_args(argv)
    try:
        if not (Path(args.output) / DATA_CONFIG).is_file():
            raise ConfigError(f"{args.output} has no {DATA_CONFIG}: not a finished data_prep "
                              "output (merge array tasks first)")
        folder = staged_uri(args.uri)
        _check(lambda: check_writable(folder))
        publish_output(str(Path(args.output).absolute()), folder, args.overwrite, args.split)
    except DataPrepError as exc:
        print(f"data_prep.upload: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


def staged_uri(uri: str) -> ObjectURI:
    """``uri`` as a dataset folder on the store; ConfigError when it is not one."""
    try:
        folder = ObjectURI.parse(uri)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not folder.prefix:
        raise ConfigError(f"{uri} names a bucket only; name a folder in it: "
                          f"s3://{folder.bucket}/<folder>")
    return folder
