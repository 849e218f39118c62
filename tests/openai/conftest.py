"""Checkpoints for the OpenAI API tests (the tiny preset itself is ``tiny_model_dir``, tests/conftest.py)."""

from __future__ import annotations

import json
import shutil

import pytest


@pytest.fixture(scope="session")
def untemplated_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny preset with no chat template."""
    folder = tmp_path_factory.mktemp("untemplated") / "no-template"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
