"""launcher.core.harness_index: lm-evaluation-harness's own tasks are found through an index
kept on disk, so a process that loads one reads only that task's folder (not the 14,683 task
files of the installed harness, 14 s on the 2-core EPYC, in every process that loaded one).
The harness here is a stand-in folder of two tasks with local data, laid out as the harness
ships its own (a folder per task family)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.core import eval_tasks, harness_index

pytest.importorskip("lm_eval")

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""


def _task(root: Path, folder: str, name: str) -> None:
    (root / folder).mkdir(parents=True, exist_ok=True)
    data = root / folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "choices": ["a", "b"],
                                        "answer": i % 2}) + "\n" for i in range(4)))
    (root / folder / f"{name}.yaml").write_text(TASK.format(name=name, data=data))


@pytest.fixture
def harness(tmp_path, monkeypatch):
    """(the stand-in harness folder, the TaskManagers built: (include paths, defaults))."""
    import lm_eval.tasks

    root = tmp_path / "harness_tasks"
    _task(root, "facts", "fake_facts")
    _task(root, "other", "fake_other")
    monkeypatch.setattr(harness_index, "harness_root", lambda: root)
    monkeypatch.setenv("TRAINWRIGHT_CACHE", str(tmp_path / "cache"))
    built = []

    class Recorded(lm_eval.tasks.TaskManager):
        def __init__(self, *args, include_path=None, include_defaults=True, **kwargs):
            built.append(({Path(p) for p in include_path or []}, include_defaults))
            super().__init__(*args, include_path=include_path,
                             include_defaults=include_defaults, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Recorded)
    return root, built


def test_a_harness_task_is_loaded_from_its_own_folder_once_indexed(harness):
    root, built = harness
    assert list(eval_tasks.load_tasks(["fake_facts"], [])) == ["fake_facts"]
    indexing = [paths for paths, _ in built if paths == {root}]
    assert len(indexing) == 1  # the harness read whole once, for the index
    assert not any(defaults for _, defaults in built)  # never the installed harness
    loads = [paths for paths, _ in built if paths != {root}]
    assert loads and all(paths <= {eval_tasks.SHIPPED, root / "facts"} for paths in loads)

    built.clear()  # another process: the stored index, no indexing of the harness
    assert list(eval_tasks.load_tasks(["fake_facts"], [])) == ["fake_facts"]
    assert built and all(paths != {root} for paths, _ in built)


def test_a_changed_harness_builds_a_new_index(harness):
    root, built = harness
    assert harness_index.task_folders(["fake_facts", "fake_new"]) == [root / "facts"]
    _task(root, "new", "fake_new")  # an upgrade, or a task file added by hand
    assert harness_index.task_folders(["fake_facts", "fake_new"]) == [root / "facts",
                                                                      root / "new"]
    assert [paths for paths, _ in built] == [{root}, {root}]


def test_an_unknown_task_name_is_still_refused_naming_the_shipped_ones(harness):
    [problem] = eval_tasks.task_problems(["no_such_task"], [])
    assert "no task named 'no_such_task'" in problem and "tw_facts" in problem


def test_a_cache_that_cannot_be_written_costs_the_index_not_the_run(harness, tmp_path,
                                                                   monkeypatch):
    root, built = harness
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("TRAINWRIGHT_CACHE", str(blocked))
    assert harness_index.task_folders(["fake_other"]) == [root / "other"]
    assert harness_index.task_folders(["fake_other"]) == [root / "other"]
    assert [paths for paths, _ in built] == [{root}, {root}]  # built each time, not stored
