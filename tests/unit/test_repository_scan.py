"""The periodic scan's view of a model folder on its own: what counts as a change, what a link
brings in, and which changes the file events already explain. Folders are made under tmp_path."""
from __future__ import annotations

import os
from pathlib import Path

from shmserve.server.broker.repository_scan import changed_paths, covered, folder_state, snapshot


def model(root: Path) -> Path:
    (root / "1").mkdir(parents=True)
    (root / "config.pbtxt").write_text('name: "m"\n')
    (root / "1" / "model.py").write_text("# v1\n")
    return root


def test_editor_temporaries_and_bytecode_change_nothing(tmp_path):
    folder = model(tmp_path / "m")
    before = folder_state(str(folder))
    (folder / "config.pbtxt~").write_text("junk")
    (folder / ".config.pbtxt.swp").write_text("junk")
    (folder / "1" / "__pycache__").mkdir()
    (folder / "1" / "__pycache__" / "model.cpython-312.pyc").write_bytes(b"\0")
    assert folder_state(str(folder)) == before


def test_a_rewritten_file_and_a_new_version_are_changes(tmp_path):
    folder = model(tmp_path / "m")
    before = folder_state(str(folder))
    staging = tmp_path / "config.staging"
    staging.write_text('name: "m"\nmax_batch_size: 0\n')
    os.replace(staging, folder / "config.pbtxt")
    (folder / "2").mkdir()
    assert changed_paths(before, folder_state(str(folder))) == {"config.pbtxt", "2"}


def test_links_are_followed_and_a_looping_link_ends(tmp_path):
    target = model(tmp_path / "elsewhere" / "m")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "m").symlink_to(target, target_is_directory=True)
    (target / "1" / "loop").symlink_to(target, target_is_directory=True)
    before = snapshot([str(repo)])
    (target / "1" / "model.py").write_text("# v2, longer\n")
    after = snapshot([str(repo)])
    assert "1/model.py" in changed_paths(before["m"], after["m"])


def test_a_model_that_came_or_went_changed_as_a_whole(tmp_path):
    state = folder_state(str(model(tmp_path / "m")))
    assert "" in changed_paths(None, state) and "" in changed_paths(state, None)
    assert changed_paths(state, state) == set()


def test_an_event_covers_its_path_and_everything_below():
    assert covered("2/model.py", {"2"}) and covered("2", {"2"}) and covered("config.pbtxt", {""})
    assert not covered("20/model.py", {"2"}) and not covered("config.pbtxt", {"2/config.pbtxt"})
