"""`tunecast probe --collectives` for real: two gloo processes on this CPU time all-reduce, all-gather and
reduce-scatter, the figures land on the local device's row, and a plan of `--gpu local` on two of them goes over
the measured link. A worker that dies, or one that never finishes, ends the probe with a one-line error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tests.unit.catalog.test_devices import cpu_rows

from tunecast.catalog.devices import COLLECTIVES, merge_device
from tunecast.catalog.store import load_catalog
from tunecast.errors import TunecastError
from tunecast.plan import collectives
from tunecast.plan.probe import device_row
from tunecast.plan.throughput import collective_link

# rank 1 fails at once, as a worker that lost its GPU would; rank 0 would wait for it in the rendezvous
LOST_RANK = ("import os, time\n"
             "if os.environ['RANK'] == '1':\n"
             "    raise RuntimeError('simulated: this rank lost its device')\n"
             "time.sleep(60)\n")


def test_two_gloo_processes_measure_the_link_a_local_plan_uses(cli, isolated_home: Path) -> None:
    catalog_dir = isolated_home / "catalog"
    here = device_row(torch.device("cpu"), load_catalog(None).gpus)
    merge_device(catalog_dir, here, cpu_rows(here.slug))  # a device probe of this CPU, by hand (it takes 30 s)

    probed = cli("probe", "--collectives", "--device", "cpu", "--gpus", "2", "--json")
    assert probed.code == 0, probed.stderr
    document = probed.json()
    assert document["processes"] == 2 and document["backend"] == "gloo"
    assert {t["collective"] for t in document["timings"]} == set(COLLECTIVES)
    assert all(t["time_us"] > 0 and t["busbw_gb_per_s"] > 0 for t in document["timings"])
    fits = {f["collective"]: f for f in document["fits"]}
    assert set(fits) == set(COLLECTIVES)
    assert all(f["latency_us"] > 0 and f["bus_gb_per_s"] > 0 for f in fits.values())
    assert document["link"]["bus_gb_per_s"] == min(f["bus_gb_per_s"] for f in fits.values())

    catalog = load_catalog(catalog_dir.resolve())
    local = catalog.gpus.get("local")
    assert local.slug == here.slug and local.measured.has("matmul")  # the device probe's figures kept
    link = collective_link(local, 2, catalog.throughput)
    assert link.name.startswith("measured by tunecast probe on 2 CPU processes (gloo")
    assert link.as_dict()["bus_gb_per_s"] == pytest.approx(document["link"]["bus_gb_per_s"], abs=0.01)
    assert link.latency_s * 1e6 == pytest.approx(document["link"]["latency_us"], rel=1e-4)


def test_a_worker_that_dies_ends_the_probe_in_one_line(cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collectives, "WORKER", (sys.executable, "-c", LOST_RANK))
    failed = cli("probe", "--collectives", "--device", "cpu", "--gpus", "2")
    assert failed.code == 2
    assert "Traceback" not in failed.stderr
    lines = failed.stderr.strip().splitlines()
    assert lines[0] == ("error: the collective probe's rank 1 exited with status 1: RuntimeError: simulated: this "
                        "rank lost its device")
    assert len(lines) == 2 and lines[1].strip().startswith("→ fix what it says")  # the message and how to fix it
    as_json = cli("probe", "--collectives", "--device", "cpu", "--json")
    assert as_json.code == 2 and as_json.json()["error"]["field"] == "--collectives"


def test_a_probe_that_never_finishes_is_stopped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(collectives, "WORKER", (sys.executable, "-c", "import time; time.sleep(60)"))
    with pytest.raises(TunecastError, match=r"did not finish within 1 s \(rank 0, 1 still running\)"):
        collectives.run_workers(2, "cpu", collectives.SIZES["cpu"], tmp_path, timeout_s=1.0)


def test_fewer_than_two_processes_is_a_user_error(cli) -> None:
    refused = cli("probe", "--collectives", "--device", "cpu", "--gpus", "1")
    assert refused.code == 2 and "a collective needs 2 processes at least" in refused.stderr
    alone = cli("probe", "--gpus", "2")
    assert alone.code == 2 and "add --collectives" in alone.stderr
