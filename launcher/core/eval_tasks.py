"""Tasks in lm-evaluation-harness's format, found in the shipped folder and ``eval.include_path``
and read from local files only.

:func:`task_problems` checks everything before any rank starts (each problem names its file and,
where there is one, its line): the include paths exist, every task of ``eval.tasks`` is found (a
YAML file that does not parse is named with its line), its data is local (``dataset_path: json``,
``csv`` or ``text`` with ``data_files``) and present, a JSON Lines file parses line by line, and
the task asks for what trainwright scores (loglikelihood, multiple choice, rolling
loglikelihood, greedy generate_until). :func:`load_tasks` then builds lm-evaluation-harness's
task objects, its own
templates, splits, few-shot samplers and metrics, with nothing downloaded.

``data_files`` may be relative: trainwright resolves it against the task file's folder
(lm-evaluation-harness itself would resolve it against the working directory).

On the ground floor because two sides read the same task files: the evaluation
(:mod:`launcher.evals`, :mod:`launcher.runtime.evaluation`) and ``data_prep``'s contamination
check (:mod:`data_prep.contamination`), which stands on launcher.core and launcher.compose only.
Torch-free and Hydra-free at import; lm-evaluation-harness and PyYAML are imported by the
functions that use them.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Iterable

from launcher.core import harness_index

SHIPPED = Path(__file__).parent / "shipped_tasks"
"""The tasks trainwright ships (written for its tests and demo): always on the include path."""
LOCAL_BUILDERS = ("json", "csv", "text", "parquet")
"""``dataset_path`` values that read ``data_files`` from disk."""
SCORED = ("loglikelihood", "multiple_choice", "loglikelihood_rolling", "generate_until")
"""Output types trainwright scores (generate_until: greedy only)."""


class TaskError(ValueError):
    """A task that cannot be used: every problem, one per line."""


def offline() -> None:
    """Nothing is fetched from a hub while tasks load (set before ``datasets`` is imported)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def include_paths(include: Iterable[str]) -> list[Path]:
    return [SHIPPED, *(Path(p).expanduser() for p in include)]


def task_manager(include: Iterable[str], harness_tasks: Iterable[str] = ()):
    """lm-evaluation-harness's index of the task files on the include path, and of the folders
    of lm-evaluation-harness's own tasks among ``harness_tasks`` (found through
    :mod:`launcher.core.harness_index`, not by reading all of its task files; their data must
    be in the local datasets cache: :func:`cached_data_problems`)."""
    offline()
    from lm_eval.tasks import TaskManager

    folders = harness_index.task_folders(harness_tasks) if harness_tasks else []
    return TaskManager(include_path=[str(p) for p in [*include_paths(include), *folders]],
                       include_defaults=False)


def task_problems(tasks: Iterable[str], include: Iterable[str]) -> list[str]:
    """Every reason the tasks cannot be loaded (empty: they can). A name the include path
    lacks is looked up among lm-evaluation-harness's own tasks."""
    return _checked(list(tasks), include)[0]


def _checked(tasks: list, include: Iterable[str]) -> tuple:
    """(:func:`task_problems`, the task manager that indexes every one of ``tasks``; None when
    there are problems or no tasks)."""
    missing = [p for p in include_paths(include) if not p.is_dir()]
    problems = [f"eval.include_path: {p} is not a directory; give folders of task YAML files"
                for p in missing]
    if not tasks or problems:
        return problems, None
    manager = task_manager(include)
    theirs = _with_harness_tasks(manager, tasks, include)
    for name in tasks:
        entry = manager.task_index.get(name)
        if _found(manager, name):
            problems += config_problems(name, Path(entry.yaml_path), entry.cfg or {})
            continue
        entry = theirs.task_index.get(name)
        if entry is None or entry.yaml_path is None:
            problems.append(unknown_task(name, manager, include))
        else:
            problems += harness_task_problems(name, Path(entry.yaml_path), entry.cfg or {})
    return problems, None if problems else theirs


def _with_harness_tasks(manager, tasks: list, include: Iterable[str]):
    """``manager``, or, when it lacks some of ``tasks``, one that also indexes the folders of
    those lm-evaluation-harness ships."""
    others = [name for name in tasks if not _found(manager, name)]
    return task_manager(include, others) if others else manager


def _found(manager, name: str) -> bool:
    """Whether ``manager`` indexes a task file of that name."""
    entry = manager.task_index.get(name)
    return entry is not None and entry.yaml_path is not None


def harness_task_problems(name: str, yaml_path: Path, cfg: dict) -> list[str]:
    """lm-evaluation-harness's own task ``name``: one task (not a group), an output type scored
    here, and its data in the local datasets cache."""
    where = f"task {name} (lm-evaluation-harness's {yaml_path})"
    if "dataset_path" not in cfg:
        return [f"{where} is a group of tasks; name the tasks themselves in eval.tasks"]
    return output_problems(where, cfg) or cached_data_problems(where, cfg)


def cached_data_problems(where: str, cfg: dict) -> list[str]:
    """The task's evaluation split read from this machine's datasets cache, offline (nothing
    is downloaded); a problem naming the dataset and how to bring it here otherwise."""
    offline()
    import datasets

    path, config = cfg["dataset_path"], cfg.get("dataset_name")
    split = cfg.get("test_split") or cfg.get("validation_split")
    try:
        datasets.load_dataset(path, config, split=split, **(cfg.get("dataset_kwargs") or {}))
    except Exception as exc:  # datasets' own errors for a dataset that is not cached
        named = f"load_dataset({path!r}" + (f", {config!r}" if config else "") + ")"
        return [f"{where}: its data ({path}" + (f", config {config}" if config else "")
                + f", split {split}) are not in this machine's datasets cache "
                f"({datasets.config.HF_DATASETS_CACHE}) and nothing is downloaded at run time "
                f"({type(exc).__name__}); on a machine with internet run python -c \"import "
                f"datasets; datasets.{named}\", then copy its datasets cache folder here "
                "(HF_DATASETS_CACHE; docs/eval.md, Tasks of lm-evaluation-harness offline)"]
    return []


def unknown_task(name: str, manager, include: Iterable[str]) -> str:
    known = sorted(n for n, e in manager.task_index.items() if e.yaml_path is not None)
    broken = [f"{path}: {why}" for path, why in unparsable_yamls(include)]
    text = (f"eval.tasks: no task named {name!r} in {', '.join(map(str, include_paths(include)))}"
            f"; known: {', '.join(known) or 'none'}")
    if broken:
        text += "; these task files do not parse: " + "; ".join(broken)
    return text


def unparsable_yamls(include: Iterable[str]) -> list[tuple[Path, str]]:
    """(file, error with its line) of every YAML file on the include path that does not parse
    (lm-evaluation-harness skips them with a log line)."""
    import yaml

    class Lenient(yaml.SafeLoader):  # lm-evaluation-harness's !function tags
        pass

    Lenient.add_multi_constructor("!", lambda loader, suffix, node: None)
    out = []
    for folder in include_paths(include):
        for path in sorted(folder.rglob("*.yaml")):
            try:
                yaml.load(path.read_text(), Loader=Lenient)
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                where = f"line {mark.line + 1}" if mark is not None else "?"
                out.append((path, f"{where}: {getattr(exc, 'problem', None) or exc}"))
    return out


def output_problems(where: str, cfg: dict) -> list[str]:
    """An output type not scored here, or a sampled generation."""
    output = cfg.get("output_type", "generate_until")
    if output not in SCORED:
        return [f"{where}: output_type {output} is not scored in the training loop; use one of "
                f"{', '.join(SCORED)}"]
    sampled = (cfg.get("generation_kwargs") or {}).get("do_sample")
    if output == "generate_until" and sampled:
        return [f"{where}: generation_kwargs.do_sample={sampled}: generation tasks are scored "
                "greedily; set do_sample: false (and temperature: 0)"]
    return []


def config_problems(name: str, yaml_path: Path, cfg: dict) -> list[str]:
    where = f"task {name} ({yaml_path})"
    problems = output_problems(where, cfg)
    if problems:
        return problems
    if cfg.get("dataset_path") not in LOCAL_BUILDERS:
        return [f"{where}: dataset_path {cfg.get('dataset_path')!r} would be downloaded; "
                "nothing is fetched at run time: give dataset_path: json (or csv, text, parquet) "
                "and dataset_kwargs.data_files naming files on disk"]
    files = data_files(cfg, yaml_path.parent)
    if not files:
        return [f"{where}: dataset_kwargs.data_files is missing; name the task's data files"]
    problems = [f"{where}: data file {path} does not exist" for path in files if not path.is_file()]
    if not problems and cfg.get("dataset_path") == "json":
        for path in files:
            problems += jsonl_problems(path, where)
    return problems


def data_files(cfg: dict, folder: Path) -> list[Path]:
    """The task's data files, relative ones against ``folder``."""
    spec = (cfg.get("dataset_kwargs") or {}).get("data_files") or {}
    values = spec.values() if isinstance(spec, dict) else [spec]
    flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
    return [p if p.is_absolute() else folder / p for p in map(Path, flat)]


def jsonl_problems(path: Path, where: str, most: int = 3) -> list[str]:
    """Lines of a JSON Lines file that are not one JSON object each (the first ``most``)."""
    import json

    problems = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ok = isinstance(json.loads(line), dict)
            except ValueError as exc:
                problems.append(f"{where}: {path}:{number}: not JSON ({exc})")
            else:
                if not ok:
                    problems.append(f"{where}: {path}:{number}: not a JSON object")
            if len(problems) >= most:
                break
    return problems


def load_tasks(tasks: Iterable[str], include: Iterable[str]) -> dict:
    """{name: lm-evaluation-harness Task} of ``tasks`` (checked first: TaskError with every
    problem)."""
    tasks = list(tasks)
    problems, manager = _checked(tasks, include)
    if problems:
        raise TaskError("\n".join(problems))
    if manager is None:  # no tasks
        manager = task_manager(include)
    configs: list = []
    for name in tasks:
        entry = manager.task_index[name]
        if Path(entry.yaml_path).is_relative_to(harness_index.harness_root()):
            configs.append(name)  # its own task, data from the datasets cache
            continue
        cfg = copy.deepcopy(entry.cfg)
        files = cfg["dataset_kwargs"]["data_files"]
        folder = Path(entry.yaml_path).parent
        cfg["dataset_kwargs"]["data_files"] = resolved(files, folder)
        configs.append(cfg)
    from lm_eval.tasks import get_task_dict

    return get_task_dict(configs, manager)


def resolved(files, folder: Path):
    """``data_files`` (a path, a list, or a dict of either) with relative paths made absolute
    against ``folder``."""
    if isinstance(files, dict):
        return {k: resolved(v, folder) for k, v in files.items()}
    if isinstance(files, list):
        return [resolved(v, folder) for v in files]
    path = Path(files)
    return str(path if path.is_absolute() else folder / path)
