"""Data shards on object storage, against a real S3 server (SeaweedFS, started by this module):
``python -m data_prep output=s3://...`` uploads its shards and commits with the manifest last;
a run whose ``data.prefixes`` are ``s3://`` reads them through the node's shard cache with the
losses of the same run on the local copy, and a second run reads the cache without touching a
shard on the store; an uncommitted, missing or unreadable dataset exits 2 naming it before any
rank starts; the cache keeps under its bound by evicting the least recently used shards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.data_prep import stdlib_documents, write_jsonl
from tests.helpers.s3 import SECRET_KEY, serve
from tests.helpers.training import REPO, TINY, steps_of, train

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("s3_data")]

BUCKET = "data"
S3_HOOK = '''
import os
import botocore.client as _client

_log, _die = os.environ.get("TW_TEST_S3_LOG", ""), os.environ.get("TW_TEST_S3_DIE", "")
_call = _client.BaseClient._make_api_call


def _make_api_call(self, operation, params):
    key = params.get("Key", "")
    if _die and operation == "PutObject" and key.endswith(_die):
        os.kill(os.getpid(), 9)
    if _log and key:
        with open(_log, "a") as f:
            f.write(f"{operation} {key}\\n")
    return _call(self, operation, params)


_client.BaseClient._make_api_call = _make_api_call
'''
"""In the processes these tests start only (a sitecustomize on their PYTHONPATH): every S3
request that names a key is appended to ``TW_TEST_S3_LOG`` as ``<operation> <key>``, in the
order sent; a PutObject of a key ending in ``TW_TEST_S3_DIE`` SIGKILLs the process first.
Nothing else of botocore or trainwright is replaced."""


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    yield from serve(tmp_path_factory, BUCKET)


def _env(s3, tmp: Path, **extra: str) -> dict:
    """The environment of a process of these tests: the server, a cache under ``tmp``, the
    request log hook."""
    hook = tmp / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(S3_HOOK)
    return s3.env(TRAINWRIGHT_CACHE=str(tmp / "cache"), PYTHONPATH=f"{hook}{os.pathsep}{REPO}",
                  **extra)


def _data_prep(env: dict, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "data_prep", "tokenizer.kind=byte", "workers=1",
                           "progress=false", "block_bytes=40000", "shard_tokens=40000",
                           "split='90,5,5'", *overrides], cwd=REPO, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)


def _requests(log: Path) -> list:
    return [tuple(line.split(" ", 1)) for line in log.read_text().splitlines()] \
        if log.exists() else []


@pytest.fixture(scope="module")
def corpus(s3, tmp_path_factory):
    """3 shards of a byte-tokenized corpus published to s3://data/corpus: (the staging
    directory, the request log of the publishing run, its stdout, the input file)."""
    root = tmp_path_factory.mktemp("corpus")
    src = write_jsonl(root / "docs.jsonl", stdlib_documents(600, max_chars=300))
    env = _env(s3, root, TW_TEST_S3_LOG=str(root / "requests.log"))
    proc = _data_prep(env, f"input={src}", f"output=s3://{BUCKET}/corpus",
                      f"staging_dir={root / 'stage'}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return root / "stage", root / "requests.log", proc.stdout, src


def _manifest(stage: Path) -> dict:
    return json.loads((stage / "manifest.json").read_text())


def test_data_prep_uploads_the_shards_then_commits_with_the_manifest_last(s3, corpus, tmp_path):
    """The store holds exactly the staged shard files (same bytes), data.yaml with the
    prefixes on the store, and the manifest, which was the last object written; the same
    command again sends no object (the store holds its very commit)."""
    stage, log, stdout, src = corpus
    manifest = _manifest(stage)
    names = [f"{e['prefix']}.{x}" for e in manifest["shards"] for x in ("bin", "idx")]
    assert len(manifest["shards"]) == 3 and manifest["complete"] is True
    keys = s3.keys(BUCKET, "corpus/")
    assert sorted(keys) == sorted([f"corpus/{n}" for n in names]
                                  + ["corpus/data.yaml", "corpus/manifest.json"])
    for name in names + ["manifest.json"]:
        stored = s3.client().get_object(Bucket=BUCKET, Key=f"corpus/{name}")["Body"].read()
        assert stored == (stage / name).read_bytes(), name
    writes = [key for op, key in _requests(log) if op == "PutObject"]
    assert writes[-1] == "corpus/manifest.json" and writes.count("corpus/manifest.json") == 1
    assert set(writes[:-1]) >= {f"corpus/{n}" for n in names} | {"corpus/data.yaml"}
    config = yaml.safe_load(s3.client().get_object(Bucket=BUCKET, Key="corpus/data.yaml")["Body"])
    prefixes = [f"s3://{BUCKET}/corpus/{e['prefix']}" for e in manifest["shards"]]
    assert config["prefixes"] == prefixes and config["split"] == "90,5,5"
    assert yaml.safe_load((stage / "conf" / "data" / "corpus.yaml").read_text()) == config
    assert f"committed: s3://{BUCKET}/corpus (3 shard(s)" in stdout

    again = tmp_path / "again.log"
    proc = _data_prep(_env(s3, tmp_path, TW_TEST_S3_LOG=str(again)), f"input={src}",
                      f"output=s3://{BUCKET}/corpus", f"staging_dir={stage}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "already committed" in proc.stdout
    assert [key for op, key in _requests(again) if op == "PutObject"
            and ".trainwright-write-check" not in key] == []


def test_data_prep_upload_publishes_an_existing_output(s3, corpus, tmp_path):
    """``python -m data_prep.upload`` of a finished local output (a merged array's, say): its
    shards under another folder, data.yaml naming them there, the manifest written last; a
    directory that holds no finished output exits 2 and sends nothing."""
    import shutil

    local = tmp_path / "out"
    shutil.copytree(corpus[0], local)
    log = tmp_path / "requests.log"
    env = {**os.environ, **_env(s3, tmp_path, TW_TEST_S3_LOG=str(log))}

    def upload(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "data_prep.upload", *args], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=120)

    proc = upload(str(local), f"s3://{BUCKET}/uploaded")
    assert proc.returncode == 0, proc.stderr[-3000:]
    writes = [key for op, key in _requests(log) if op == "PutObject"
              and ".trainwright-write-check" not in key]
    assert writes[-1] == "uploaded/manifest.json" and len(writes) == 3 * 2 + 2
    config = yaml.safe_load(s3.client().get_object(Bucket=BUCKET,
                                                   Key="uploaded/data.yaml")["Body"])
    assert config["prefixes"] == [f"s3://{BUCKET}/uploaded/corpus_0000{i}" for i in range(3)]
    (tmp_path / "empty").mkdir()
    log.unlink()
    refused = upload(str(tmp_path / "empty"), f"s3://{BUCKET}/empty")
    assert refused.returncode == 2 and "not a finished data_prep output" in refused.stderr
    assert _requests(log) == [] and s3.keys(BUCKET, "empty/") == {}


def _store_run(s3, tmp: Path, name: str, stage: Path, *extra: str, expect: int = 0,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """The tiny model trained on the data config data_prep wrote (prefixes on the store)."""
    return train(tmp, name, f"hydra.searchpath=[file://{stage / 'conf'}]", "data=corpus",
                 "trainer.train_steps=3", "trainer.eval_interval=0", *extra, expect=expect,
                 env=env or _env(s3, tmp))


def _losses(run_dir: Path) -> list:
    steps = steps_of(run_dir)
    return [(s, steps[s]["loss"], steps[s]["grad_norm"]) for s in sorted(steps)]


def test_training_reads_the_store_like_the_local_copy_then_from_the_cache_only(s3, corpus,
                                                                               tmp_path):
    """The same run on the staged (local) shards and on their s3:// prefixes: equal losses and
    gradient norms at every step; the first s3 run downloads the 3 shards into the cache
    (byte-identical to the staged ones), the second reads the cache: it reads no shard object
    of the store (its request log names none) and leaves the cached files as they were."""
    stage = corpus[0]
    config = yaml.safe_load((stage / "data.yaml").read_text())
    local = dict(config, name="local", prefixes=[str(stage / p.rsplit("/", 1)[1])
                                                 for p in config["prefixes"]])
    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "conf" / "data" / "local.yaml").write_text(yaml.safe_dump(local))
    train(tmp_path, "local", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "data=local",
          "trainer.train_steps=3", "trainer.eval_interval=0")

    first = _store_run(s3, tmp_path, "store", stage)
    assert "[data] 3 shard(s) on the store: 3 downloaded" in first.stderr, first.stderr[-3000:]
    cached = tmp_path / "cache" / "shards" / BUCKET / "corpus"
    shards = sorted(p.name for p in stage.glob("corpus_*.*"))
    assert sorted(p.name for p in cached.glob("corpus_*.bin")) == \
        [n for n in shards if n.endswith(".bin")]
    for name in shards:
        assert (cached / name).read_bytes() == (stage / name).read_bytes(), name
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in cached.glob("corpus_*")}

    log = tmp_path / "second.log"
    second = _store_run(s3, tmp_path, "cached", stage,
                        env=_env(s3, tmp_path, TW_TEST_S3_LOG=str(log)))
    assert "3 shard(s) on the store: 0 downloaded" in second.stderr
    assert "3 already in the cache" in second.stderr
    touched = [key for _, key in _requests(log) if key.endswith((".bin", ".idx"))]
    assert touched == [] and ("GetObject", "corpus/manifest.json") in _requests(log)
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in cached.glob("corpus_*") if not p.name.endswith(".cached")} == \
        {k: v for k, v in before.items() if not k.endswith(".cached")}
    reference = _losses(tmp_path / "local")
    assert len(reference) == 3
    assert _losses(tmp_path / "store") == reference
    assert _losses(tmp_path / "cached") == reference


def test_data_shard_cache_dir_is_the_only_cache_the_launcher_and_ranks_fill(s3, corpus,
                                                                           tmp_path):
    """data.shard_cache_dir set: the launcher's copy before the ranks start lands there, and the
    default cache ($TRAINWRIGHT_CACHE/shards) stays empty (it was filled instead, then the ranks
    downloaded a second copy into the configured one)."""
    own = tmp_path / "own_cache"
    run = _store_run(s3, tmp_path, "own", corpus[0], f"data.shard_cache_dir={own}")
    assert "[data] 3 shard(s) on the store: 3 downloaded" in run.stderr, run.stderr[-3000:]
    assert len(list(own.rglob("corpus_*.bin"))) == 3
    assert not (tmp_path / "cache" / "shards").exists()


def test_a_publish_killed_before_its_manifest_leaves_no_dataset(s3, corpus, tmp_path):
    """data_prep SIGKILLed as it writes the manifest: every shard is on the store but the
    folder is not committed, and a run on it exits 2 naming the folder and the missing
    manifest before any rank starts; the same command again commits it."""
    src = corpus[3]
    env = _env(s3, tmp_path, TW_TEST_S3_DIE="manifest.json")
    killed = _data_prep(env, f"input={src}", f"output=s3://{BUCKET}/killed")
    assert killed.returncode == -9, killed.stderr[-3000:]
    keys = s3.keys(BUCKET, "killed/")
    assert "killed/manifest.json" not in keys and "killed/killed_00000.bin" in keys
    stage = tmp_path / "cache" / "data_prep" / BUCKET / "killed"
    config = yaml.safe_load((stage / "data.yaml").read_text())
    assert config["prefixes"][0] == f"s3://{BUCKET}/killed/killed_00000"
    proc = train(tmp_path, "run", f"hydra.searchpath=[file://{stage / 'conf'}]", "data=killed",
                 "trainer.train_steps=2", expect=2, env=_env(s3, tmp_path))
    assert (f"s3://{BUCKET}/killed is not a committed dataset (no "
            f"s3://{BUCKET}/killed/manifest.json)") in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()
    assert not list((tmp_path / "cache" / "shards").rglob("*.bin"))

    again = _data_prep(_env(s3, tmp_path), f"input={src}", f"output=s3://{BUCKET}/killed")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "killed/manifest.json" in s3.keys(BUCKET, "killed/")


def _copy_folder(s3, source: str, target: str) -> None:
    client = s3.client()
    for key in s3.keys(BUCKET, source + "/"):
        client.copy_object(Bucket=BUCKET, Key=target + key[len(source):],
                           CopySource={"Bucket": BUCKET, "Key": key})


CASES = {
    "missing_object": ("s3://data/nobin/corpus_00001",
                       "s3://data/nobin/corpus_00001.bin is missing, the manifest"),
    "unlisted_shard": ("s3://data/corpus/corpus_00007",
                       "lists no shard 'corpus_00007' (it has 3)"),
    "bucket": ("s3://nosuchbucket/corpus/corpus_00000",
               "bucket 'nosuchbucket'): the bucket does not exist"),
    "credentials": ("s3://data/corpus/corpus_00000", "access denied"),
}


@pytest.mark.parametrize("module", ["launcher.train", "launcher.submit"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_dataset_that_cannot_be_read_exits_2_naming_it(s3, corpus, tmp_path, case, module):
    """A missing object, a shard the manifest does not list, a missing bucket, wrong
    credentials: exit 2 before any rank (or job) starts, naming the URI and what is wrong,
    never the secret; nothing is downloaded."""
    if case == "missing_object" and "nobin/manifest.json" not in s3.keys(BUCKET, "nobin/"):
        _copy_folder(s3, "corpus", "nobin")
        s3.client().delete_object(Bucket=BUCKET, Key="nobin/corpus_00001.bin")
    prefix, expect = CASES[case]
    env = _env(s3, tmp_path, **({"AWS_SECRET_ACCESS_KEY": "wrong-secret-xyz"}
                                if case == "credentials" else {}))
    proc = subprocess.run(
        [sys.executable, "-m", module, *TINY, f"data.prefixes=[{prefix}]",
         f"run.output_root={tmp_path / 'runs'}", "run.name=x",
         *(["submit.dry_run=true"] if module == "launcher.submit" else [])],
        cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert expect in proc.stderr and "data.prefixes" in proc.stderr, proc.stderr[-3000:]
    assert "wrong-secret-xyz" not in proc.stderr and SECRET_KEY not in proc.stderr
    assert not (tmp_path / "runs").exists()
    assert not (tmp_path / "cache" / "shards").exists() or \
        not list((tmp_path / "cache" / "shards").rglob("*.bin"))


def test_submit_checks_the_store_and_leaves_the_download_to_the_job(s3, corpus, tmp_path):
    """launcher.submit of a run on s3:// shards renders its job after checking the store, and
    downloads nothing on the submitting machine (the job's nodes do)."""
    stage = corpus[0]
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.submit", *TINY, "cluster=slurm_cpu",
         f"hydra.searchpath=[file://{stage / 'conf'}]", "data=corpus", "submit.dry_run=true",
         f"run.output_root={tmp_path / 'runs'}"],
        cwd=REPO, env={**os.environ, **_env(s3, tmp_path)}, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "cache" / "shards").exists()


@pytest.fixture
def store_env(s3, monkeypatch):
    """This test process talks to the server (a fresh client before and after)."""
    from launcher.core import objectstore

    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    objectstore._client.cache_clear()
    yield
    objectstore._client.cache_clear()


def test_the_cache_evicts_the_least_recently_used_shards_to_its_bound(s3, corpus, tmp_path,
                                                                     store_env):
    """A bound of 2.5 shards: shards 0 and 1 are cached, 0 is used again, then 2 evicts 1
    (the least recently used), never 0; a run reading all 3 is refused naming
    data.shard_cache_gb; a damaged copy (a truncated .bin) is not taken from the cache but
    downloaded again."""
    from launcher.core.remote_data import DataUnavailable
    from launcher.core.shard_cache import ShardCache

    manifest = _manifest(corpus[0])
    sizes = [e["bin_bytes"] + e["idx_bytes"] for e in manifest["shards"]]
    prefixes = [f"s3://{BUCKET}/corpus/{e['prefix']}" for e in manifest["shards"]]
    cache = ShardCache.at(str(tmp_path / "shards"), gb=(max(sizes) * 2.5) / 1e9)

    def held() -> list:
        return sorted(p.name for p in cache.root.rglob("*.cached"))

    cache.localize(prefixes[:1])
    cache.localize(prefixes[1:2])
    assert held() == ["corpus_00000.cached", "corpus_00001.cached"]
    assert cache.localize(prefixes[:1]) == [str(cache.root / BUCKET / "corpus" / "corpus_00000")]
    cache.localize(prefixes[2:])
    assert held() == ["corpus_00000.cached", "corpus_00002.cached"]
    assert not (cache.root / BUCKET / "corpus" / "corpus_00001.bin").exists()
    assert sum(f.stat().st_size for f in cache.root.rglob("corpus_*.*")
               if f.suffix in (".bin", ".idx")) <= cache.limit_bytes

    with pytest.raises(DataUnavailable, match=r"data.shard_cache_gb=.* holds less than the 3 "):
        cache.localize(prefixes)

    local = Path(cache.local_prefix(prefixes[0]) + ".bin")
    os.truncate(local, 10)
    assert cache.cached(prefixes[:1]) is None
    cache.localize(prefixes[:1])
    assert local.read_bytes() == (corpus[0] / "corpus_00000.bin").read_bytes()
    assert not list(cache.root.rglob("*.part"))


def test_a_replaced_object_is_refused_by_its_crc(s3, corpus, tmp_path, store_env):
    """An object replaced on the store by other bytes of the same size: the download is
    refused naming the key and the CRC-32, and nothing stands under the shard's name."""
    from launcher.core.remote_data import DataUnavailable
    from launcher.core.shard_cache import ShardCache

    _copy_folder(s3, "corpus", "replaced")
    size = s3.keys(BUCKET, "replaced/")["replaced/corpus_00000.bin"]
    s3.client().put_object(Bucket=BUCKET, Key="replaced/corpus_00000.bin", Body=b"\1" * size)
    cache = ShardCache.at(str(tmp_path / "shards"))
    with pytest.raises(DataUnavailable, match=r"s3://data/replaced/corpus_00000.bin has CRC-32"):
        cache.localize([f"s3://{BUCKET}/replaced/corpus_00000"])
    folder = cache.root / BUCKET / "replaced"
    assert not [p.name for p in folder.iterdir() if p.name.startswith("corpus_00000")]
