"""A dataset in the local Hugging Face datasets cache, as ``datasets.load_dataset(path, config)``
leaves it on a machine with internet (``<cache>/<namespace>___<name>/<config>/<version>/<hash>``
with its arrow files and ``dataset_info.json``), built here from rows without a download: the
offline tests of lm-evaluation-harness's own tasks read it as they would a real cached copy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def cache_dataset(cache: Path, path: str, config: str, splits: dict) -> Path:
    """``splits`` ({split: [row dicts]}) cached as dataset ``path`` (namespace/name), config
    ``config``, under the datasets cache ``cache``; the cached folder."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = cache.parent / "hf_cache_source"
    source.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows), source / f"{split}.parquet")
        files[split] = str(source / f"{split}.parquet")
    builder = datasets.load_dataset_builder("parquet", data_files=files,
                                            cache_dir=str(source / "build"))
    builder.download_and_prepare()
    built = Path(builder.cache_dir)
    namespace, name = path.split("/")
    target = cache / f"{namespace}___{name}" / config / "0.0.0" / built.name
    shutil.copytree(built, target)
    for arrow in target.glob("parquet-*.arrow"):
        arrow.rename(target / arrow.name.replace("parquet-", f"{name}-"))
    info = json.loads((target / "dataset_info.json").read_text())
    info.update(config_name=config, dataset_name=name)
    (target / "dataset_info.json").write_text(json.dumps(info))
    return target
