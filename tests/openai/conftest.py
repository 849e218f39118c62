"""Checkpoints for the OpenAI API tests (the tiny preset itself is ``tiny_model_dir``, tests/conftest.py), and
the deployment they share."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.serving.conftest import start_deployment


@pytest.fixture(scope="package")
def served(ray_session, serving_model):
    """One deployment (router with the OpenAI API, a prefill and a decode worker) for the package's tests."""
    # 10 ms per decode step: a long request runs for tens of seconds, so a cancel is visible.
    deployment = start_deployment(serving_model, openai_port=0, faults={"decode_step_delay_s": 0.01})
    yield deployment
    deployment.stop()


@pytest.fixture(scope="session")
def untemplated_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny preset with no chat template."""
    folder = tmp_path_factory.mktemp("untemplated") / "no-template"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
