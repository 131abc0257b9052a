"""The three ZeRO-3 construction jobs of test_hf_alias_zero3.py in one launch: each rank runs the
unmodified scripts one after the other, as ``__main__``, in the ranks' one process group (two
ranks importing torch and transformers once, not three times):

    MODEL_DIR=saved_gpt2 REPORT_DIR=out python -m deepspeed_cpp.launcher --num_gpus 2 \
        --alias-deepspeed tests/hf_zero3_jobs.py --deepspeed ds_config.json --output_dir ...

hf_zero3_guide_job.py writes ``REPORT_DIR/guide/rank<N>.json``, hf_zero3_half_job.py
``REPORT_DIR/half/rank<N>.json``, then hf_zero3_trainer_job.py gets this script's arguments.
Before each job no stage-3 config may be alive: what one job left behind must not make the next
one's models partitioned (each must be partitioned by its own config), so a job whose config
outlives it stops the run here.
"""

import gc
import os
import runpy
import sys
from pathlib import Path

from transformers.integrations import is_deepspeed_zero3_enabled

HERE = Path(__file__).resolve().parent
REPORTS = Path(os.environ["REPORT_DIR"])
TRAINER_ARGUMENTS = sys.argv[1:]  # read before the jobs' own sys.argv replace it


def run_job(name: str, report_dir: Path | None, argv: list[str]) -> None:
    gc.collect()
    assert not is_deepspeed_zero3_enabled(), f"a stage-3 config outlived the job before {name}"
    if report_dir is not None:
        os.environ["REPORT_DIR"] = str(report_dir)
    script = str(HERE / name)
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")  # its globals (models, configs) dropped here


run_job("hf_zero3_guide_job.py", REPORTS / "guide", [])
run_job("hf_zero3_half_job.py", REPORTS / "half", [])
run_job("hf_zero3_trainer_job.py", None, TRAINER_ARGUMENTS)
