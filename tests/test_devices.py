"""Device leases: concurrent training launches get disjoint devices, and a dead holder frees its devices."""
import signal
import subprocess
import sys
import textwrap

import dagster as dg
import pytest

from conftest import PROJECT_ROOT
from resources.devices import DevicesBusy, lease_devices
from resources.msrun import MsrunResource

DEVICES = ["0", "1", "2", "3"]


def test_leases_are_disjoint_and_name_their_holders(tmp_path):
    with lease_devices(DEVICES, 2, tmp_path, {"run_id": "run-a"}) as first:
        with lease_devices(DEVICES, 2, tmp_path, {"run_id": "run-b"}) as second:
            assert (first, second) == (["0", "1"], ["2", "3"])
            with pytest.raises(DevicesBusy, match=r"2 of devices 0,1,2,3 wanted, 0 free.*device 0 by .*run-a"
                                                  r".*device 3 by .*run-b"):
                with lease_devices(DEVICES, 2, tmp_path, {"run_id": "run-c"}):
                    pass
        # run-b's devices are free again; a half-free set is not taken
        with lease_devices(DEVICES, 2, tmp_path, {"run_id": "run-c"}) as third:
            assert third == ["2", "3"]
        with pytest.raises(DevicesBusy, match="3 of devices 0,1,2,3 wanted, 2 free"):
            with lease_devices(DEVICES, 3, tmp_path, {"run_id": "run-d"}):
                pass
    with pytest.raises(DevicesBusy, match="5 devices asked for, but only 4 are visible"):
        with lease_devices(DEVICES, 5, tmp_path, {}):
            pass


def test_a_killed_holder_frees_its_devices(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(PROJECT_ROOT)!r})
        from pathlib import Path
        from resources.devices import lease_devices
        with lease_devices(["0", "1"], 2, Path({str(tmp_path)!r}), {{"run_id": "killed"}}):
            print("held", flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DevicesBusy, match="killed"):
            with lease_devices(["0", "1"], 1, tmp_path, {}):
                pass
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        with lease_devices(["0", "1"], 2, tmp_path, {}) as leased:
            assert leased == ["0", "1"]
    finally:
        holder.kill()


def test_each_launch_gets_its_leased_devices_as_visible_devices(tmp_path):
    msrun = MsrunResource(worker_num=2, local_worker_num=2, visible_devices="0,1,2,3",
                          device_lease_dir=str(tmp_path), device_wait_s=0)
    context = dg.build_asset_context()
    with msrun.devices(context) as first, msrun.devices(context) as second:
        assert [msrun.environment({}, v)["ASCEND_RT_VISIBLE_DEVICES"] for v in (first, second)] == ["0,1", "2,3"]
        with pytest.raises(dg.Failure, match="MsrunResource.visible_devices: 2 of devices 0,1,2,3 wanted, 0 free"):
            with msrun.devices(context):
                pass
    with MsrunResource(visible_devices=None).devices(context) as cpu:  # CPU: nothing to lease
        assert cpu is None
