"""A candidate as a ``config.pbtxt``: the model's own config with the instance count, max batch
size and dynamic batcher changed, written into a temporary repository of its own (the version
folders linked, not copied) so that the user's repository is never touched."""
from __future__ import annotations

import shutil
from pathlib import Path

from google.protobuf import text_format

from shmserve.server.broker.config import ModelConfig, parse_config_text
from shmserve.tools.analyzer.space import Candidate


def read_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.pbtxt"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.pbtxt: the analyzer changes a config it can read")
    return parse_config_text(path.read_text(), model_dir.name)


def apply(base: ModelConfig, c: Candidate) -> ModelConfig:
    """``base`` with the candidate's knobs; the rest (inputs, backend, parameters) as it was."""
    config = ModelConfig()
    config.CopyFrom(base)
    if not config.instance_group:
        config.instance_group.add()
    for group in config.instance_group:
        group.count = c.instances
    config.max_batch_size = c.max_batch_size
    if c.max_batch_size and not config.HasField("sequence_batching"):
        batcher = config.dynamic_batching
        del batcher.preferred_batch_size[:]
        batcher.preferred_batch_size.extend(c.preferred)
        batcher.max_queue_delay_microseconds = c.queue_delay_us
    elif config.HasField("dynamic_batching"):
        config.ClearField("dynamic_batching")
    return config


def config_text(config: ModelConfig) -> str:
    return text_format.MessageToString(config)


def write_repository(root: Path, model_dir: Path, config: ModelConfig) -> Path:
    """``root``/<model>: the config given, every other entry of the model's folder linked."""
    if root.exists():
        shutil.rmtree(root)
    target = root / model_dir.name
    target.mkdir(parents=True)
    for entry in model_dir.iterdir():
        if entry.name != "config.pbtxt":
            (target / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    (target / "config.pbtxt").write_text(config_text(config))
    return root
