"""Importing SkyPilot catalog files: columns by name, cheapest region per instance type, every skipped
row counted, cloud-specific GPU names, GCP host VMs."""

from datetime import date

import pytest

from tunecast.catalog.skypilot import import_skypilot, parse_skypilot
from tunecast.catalog.store import load_catalog
from tunecast.errors import TunecastError

# Shaped like catalogs/v8/aws/vms.csv (GpuInfo shortened).
AWS = """InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,AvailabilityZone,Arch
p4de.24xlarge,A100-80GB,8.0,96.0,1152.0,"{'Gpus': []}",27.44705,10.0,us-east-1,use1-az6,x86_64
p4de.24xlarge,A100-80GB,8.0,96.0,1152.0,"{'Gpus': []}",29.0,8.0,us-west-2,usw2-az1,x86_64
p5.48xlarge,H100,8.0,192.0,2048.0,"{'Gpus': []}",55.04,55.04,us-east-1,use1-az6,x86_64
g4dn.xlarge,T4,1.0,4.0,16.0,"{'Gpus': []}",0.526,0.2,us-east-1,use1-az6,x86_64
m5.large,,,2.0,8.0,,0.096,0.04,us-east-1,use1-az6,x86_64
"""

# RunPod's column order differs, and its A100-80GB is the PCIe card.
RUNPOD = """InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Region,SpotPrice,Price,AvailabilityZone,GpuInfo
1x_A100-80GB_SECURE,A100-80GB,1.0,8.0,117.0,US,1.39,1.39,US-TX-1,
1x_A100-80GB-SXM_SECURE,A100-80GB-SXM,1.0,8.0,117.0,US,,1.49,US-TX-1,
"""

# GCP: accelerators and host VMs are separate rows; 700.0 marks "not offered".
GCP = """InstanceType,vCPUs,MemoryGiB,AcceleratorName,AcceleratorCount,GpuInfo,Region,AvailabilityZone,Price,SpotPrice
a2-ultragpu-1g,12.0,170.0,,,,us-central1,us-central1-a,1.0,0.4
,,,A100-80GB,1,A100-80GB,us-central1,us-central1-a,4.0,1.6
,,,A100-80GB,1,A100-80GB,europe-west4,europe-west4-a,700.0,700.0
,,,H200,8,H200,us-central1,us-central1-a,80.0,30.0
"""


def test_aws_cheapest_region_per_instance_and_spot_only_when_real(catalog) -> None:
    result = parse_skypilot(AWS, catalog, provider="aws", as_of=date(2026, 11, 1), source="aws/vms.csv")
    offers = {o.instance_type: o for o in result.offers}
    p4de = offers["p4de.24xlarge"]
    assert (p4de.gpu, p4de.gpu_count, p4de.region) == ("a100-80gb", 8, "us-east-1")
    assert p4de.usd_per_hour == pytest.approx(27.44705 / 8) and p4de.spot_usd_per_hour == pytest.approx(1.0)
    assert offers["p5.48xlarge"].spot_usd_per_hour is None  # spot equal to on-demand is no spot tier
    assert (p4de.billing_increment_s, p4de.minimum_charge_s) == (1, 60)
    assert result.skipped == {"GPU T4 is not in the GPU catalog": 1, "no GPU (CPU-only instance or host VM)": 1}


def test_runpod_names_map_to_the_right_form_factor(catalog) -> None:
    result = parse_skypilot(RUNPOD, catalog, provider="runpod", as_of=date(2026, 11, 1), source="runpod/vms.csv")
    assert {o.instance_type: o.gpu for o in result.offers} == {
        "1x_A100-80GB_SECURE": "a100-80gb-pcie", "1x_A100-80GB-SXM_SECURE": "a100-80gb"}


def test_gcp_gpu_rows_are_priced_with_their_host_vm(catalog) -> None:
    result = parse_skypilot(GCP, catalog, provider="gcp", as_of=date(2026, 11, 1), source="gcp/vms.csv")
    [offer] = result.offers
    assert (offer.instance_type, offer.gpu, offer.usd_per_hour, offer.spot_usd_per_hour) == (
        "a2-ultragpu-1g", "a100-80gb", 5.0, 2.0)
    assert result.skipped["no usable price or GPU count"] == 1
    assert result.skipped["GPU listed without a host VM to price it with"] == 1


def test_import_merges_into_the_user_catalog_and_replaces_on_reimport(tmp_path, catalog) -> None:
    cloud = tmp_path / "aws"
    cloud.mkdir()
    (cloud / "vms.csv").write_text(AWS)
    user = tmp_path / "mine"
    first = import_skypilot(cloud / "vms.csv", catalog, provider=None, as_of="2026-11-01", user_dir=user)
    assert first.provider == "aws" and first.written_to == user / "offers.csv"
    import_skypilot(cloud / "vms.csv", catalog, provider=None, as_of="2026-11-02", user_dir=user)
    merged = [o for o in load_catalog(user).offers if o.source == str((cloud / "vms.csv").resolve())]
    assert len(merged) == 2 and {o.as_of for o in merged} == {date(2026, 11, 2)}


def test_a_file_that_is_not_a_skypilot_catalog_is_refused(tmp_path, catalog) -> None:
    path = tmp_path / "prices.csv"
    path.write_text("gpu,price\nh100,2\n")
    with pytest.raises(TunecastError, match="AcceleratorName"):
        import_skypilot(path, catalog, provider="x", as_of=None, user_dir=tmp_path)
