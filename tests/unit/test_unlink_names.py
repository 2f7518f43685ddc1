"""Removing a name in /dev/shm that is not ours to remove (another user's file in the sticky
directory, a directory) must not raise: the broker removes a departed client's FIFO, and an
exception there ended the broker."""
from __future__ import annotations

import os

from shmserve.shm.names import unlink_path


def test_a_name_that_cannot_be_removed_is_left_and_said(tmp_path, caplog):
    blocker = tmp_path / "client.fifo"
    blocker.mkdir()  # (os.unlink of a directory fails, as of another user's FIFO in a sticky /dev/shm)
    with caplog.at_level("WARNING", logger="shmserve"):
        assert unlink_path(str(blocker)) is False
    assert blocker.is_dir() and "could not be removed" in caplog.text


def test_a_name_already_gone_is_no_news(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="shmserve"):
        assert unlink_path(str(tmp_path / "gone.fifo")) is False
    assert caplog.text == ""


def test_a_fifo_of_ours_is_removed(tmp_path):
    fifo = tmp_path / "ours.fifo"
    os.mkfifo(fifo)
    assert unlink_path(str(fifo)) is True and not fifo.exists()
