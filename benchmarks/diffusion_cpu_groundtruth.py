"""CPU ground truth for the diffusion memory estimate: real training steps measured by an independent instrument.

Each case builds a diffusers pipeline's denoiser, VAE and text encoders from the catalog's configs with random weights
(the real architecture; FLUX and SD3 keep their published widths but only a few of their blocks, SHRUNK), runs two
real training steps on the CPU (tunecast.step.diffusion.train_step, the step the estimate traces), and measures how
far the process's resident memory grows above a baseline taken just before the models are built. glibc is told to
return freed memory at once (MALLOC_MMAP_THRESHOLD_=65536), so resident memory follows live memory, as in
benchmarks/cpu_memory_groundtruth.py. The estimate is `tunecast memory --device cpu`'s `device_total_gib` for the
same run (estimate/diffusion.py), which adds the framework's own growth (`cpu_framework` of overheads.csv).

Run:  .venv/bin/python benchmarks/diffusion_cpu_groundtruth.py                 (all cases, about 10 min here)
      .venv/bin/python benchmarks/diffusion_cpu_groundtruth.py --only CASE …   (those cases; other rows kept)
Writes the table between the diffusion-cpu-groundtruth markers of docs/validation/memory.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

from cpu_memory_groundtruth import measure, rss, table_rows, write_table

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "validation" / "memory.md"
MARK = "diffusion-cpu-groundtruth"

# name: (catalog pipeline, RunSpec settings). Resolutions are reduced (the CPU's time), the architectures real.
CASES: dict[str, tuple[str, dict]] = {
    "sd15-lora-256": ("runwayml/stable-diffusion-v1-5", {"method": "lora", "lora": {"rank": 4}, "micro_batch": 1,
                                                         "diffusion": {"resolution": 256}}),
    "sd15-lora-ckpt-384-b2": ("runwayml/stable-diffusion-v1-5", {"method": "lora", "lora": {"rank": 16},
                                                                 "micro_batch": 2, "grad_checkpointing": True,
                                                                 "diffusion": {"resolution": 384}}),
    "sd15-full-256-cached": ("runwayml/stable-diffusion-v1-5", {"method": "full", "micro_batch": 1,
                                                                "diffusion": {"resolution": 256, "cache_latents": True,
                                                                              "cache_text": True}}),
    "sdxl-lora-ckpt-256": ("stabilityai/stable-diffusion-xl-base-1.0", {"method": "lora", "lora": {"rank": 8},
                                                                        "micro_batch": 1, "grad_checkpointing": True,
                                                                        "diffusion": {"resolution": 256}}),
    "flux-dev-4blocks-lora-256": ("black-forest-labs/FLUX.1-dev", {"method": "lora", "lora": {"rank": 4},
                                                                   "micro_batch": 1,
                                                                   "diffusion": {"resolution": 256}}),
    "sd3-medium-4blocks-lora-256": ("stabilityai/stable-diffusion-3-medium-diffusers",
                                    {"method": "lora", "lora": {"rank": 4}, "micro_batch": 1,
                                     "diffusion": {"resolution": 256}}),
}
# Transformer blocks kept of a case's published config: FLUX.1-dev 2 double-stream and 2 single-stream blocks of its
# 19 and 38; SD3 Medium 4 of its 24.
SHRUNK: dict[str, dict[str, int]] = {"flux-dev-4blocks-lora-256": {"num_layers": 2, "num_single_layers": 2},
                                     "sd3-medium-4blocks-lora-256": {"num_layers": 4}}
COLUMNS = ("case", "pipeline", "settings", "measured GiB", "predicted GiB", "error", "live tensors GiB", "peak phase",
           "measured on")


def _pipeline_folder(name: str, model: str) -> str:
    """The catalog pipeline `model`, or a copy of its configs with the denoiser shrunk where SHRUNK says."""
    if name not in SHRUNK:
        return model
    from tunecast.catalog.diffusion import DATA

    folder = Path(tempfile.mkdtemp(prefix="tunecast-diffusion-"))
    source = DATA / model.replace("/", "__", 1)
    shutil.copytree(source, folder, dirs_exist_ok=True)
    config_path = folder / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config.update(SHRUNK[name])
    config_path.write_text(json.dumps(config))
    return str(folder)


def _spec(model: str, settings: dict):  # type: ignore[no-untyped-def]
    from tunecast.config.spec import RunSpec

    return RunSpec.model_validate({"model": model, **settings})


def child(model: str, settings: dict) -> dict:
    """Runs in a fresh process: the models with random weights, two training steps, measured."""
    import diffusers  # noqa: F401 - imported before the baseline, as the estimate's process has it
    import torch
    import transformers  # noqa: F401

    from tunecast.catalog.diffusion import load_pipeline
    from tunecast.estimate.diffusion import diffusion_settings, diffusion_shape
    from tunecast.step.diffusion import build_denoiser, build_text_encoders, build_vae, denoiser_class, train_step
    from tunecast.step.setup import make_optimizer

    pipeline = load_pipeline(model)
    spec = _spec(model, settings)
    step_settings, shape = diffusion_settings(spec), diffusion_shape(spec, pipeline)
    denoiser_class(pipeline)  # the lazy module's import, before the baseline
    torch.manual_seed(0)
    baseline = rss()
    denoiser = build_denoiser(pipeline, step_settings, device="cpu")
    vae = None if shape.cache_latents else build_vae(pipeline, step_settings, device="cpu")
    encoders = [] if shape.cache_text else build_text_encoders(pipeline, step_settings, device="cpu")
    optimizer = make_optimizer(step_settings.optimizer, [p for p in denoiser.parameters() if p.requires_grad])

    def optimizer_step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        train_step(denoiser, vae, optimizer_step, pipeline, step_settings, shape.batch, shape.height, shape.width,
                   shape.frames)
        seconds.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del encoders
    return {"growth_bytes": peak - baseline, "step_seconds": seconds}


def estimate(model: str, settings: dict) -> dict:
    from tunecast.catalog.diffusion import load_pipeline
    from tunecast.catalog.store import load_catalog
    from tunecast.estimate.diffusion import answer_diffusion_memory

    answer = answer_diffusion_memory(_spec(model, settings), load_pipeline(model), None,
                                     load_catalog(None).overheads, device="cpu")
    return answer.estimate.as_dict()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child")
    parser.add_argument("--only", nargs="*", help="measure these cases only; the table keeps the other rows")
    args = parser.parse_args()
    if args.child:
        model, settings = json.loads(args.child)
        print(json.dumps(child(model, settings)))
        return 0
    rows = table_rows(DOC, MARK, CASES, COLUMNS)
    today = time.strftime("%Y-%m-%d")
    for name, (model, settings) in CASES.items():
        if args.only and name not in args.only:
            continue
        folder = _pipeline_folder(name, model)
        measured = measure(folder, settings, __file__)
        predicted = estimate(folder, settings)
        growth = measured["growth_bytes"] / 2**30
        error = (predicted["device_total_gib"] - growth) / growth
        shown_model = model + (" (" + ", ".join(f"{k} {v}" for k, v in SHRUNK[name].items()) + ")"
                               if name in SHRUNK else "")
        shown = json.dumps(settings, separators=(", ", ": ")).replace("|", "/")
        rows[name] = [name, shown_model, f"`{shown}`", f"{growth:.3f}", f"{predicted['device_total_gib']:.3f}",
                      f"{error:+.1%}", f"{predicted['peak_allocated_gib']:.3f}", predicted["peak_phase"], today]
        print(f"{name}: measured {growth:.3f} GiB, predicted {predicted['device_total_gib']:.3f} GiB ({error:+.1%}); "
              f"steps {', '.join(f'{s:.1f}' for s in measured['step_seconds'])} s", flush=True)
    write_table(DOC, MARK, "diffusion_cpu_groundtruth.py",
                f"torch {__import__('torch').__version__}, diffusers {__import__('diffusers').__version__}",
                [rows[name] for name in CASES if name in rows], COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
