"""The msrun launcher: MindFormers' argument forms, its errors, and the Dagster resource's identical command."""
import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

import dagster as dg
import pytest

from resources.msrun import MsrunNode, MsrunResource, _MessageHandler
from training import launch
from training.launch import MsrunSettings, SettingError, msrun_command, msrun_environment
from training.run import main as train_main

MSRUN = launch.msrun_executable()
TRAIN = "python -m training.run --config runs/qwen3_tiny/config.yaml --mode 1"
TRAIN_ARGS = ["-m", "training.run", "--config", "runs/qwen3_tiny/config.yaml", "--mode", "1"]


def dry_run(capsys, *argv: str) -> list[str]:
    launch.main(["--dry-run", *argv])
    return shlex.split(capsys.readouterr().out)


def expected(worker_num, local_worker_num, master_addr, master_port, node_rank, log_dir, cluster_time_out,
             script_args=TRAIN_ARGS) -> list[str]:
    return [MSRUN, f"--worker_num={worker_num}", f"--local_worker_num={local_worker_num}",
            f"--master_addr={master_addr}", f"--master_port={master_port}", f"--node_rank={node_rank}",
            f"--log_dir={log_dir}", "--join=True", f"--cluster_time_out={cluster_time_out}", "--tail_worker_log=-1",
            "python", *script_args]


def test_msrun_comes_from_this_interpreter():
    assert MSRUN == str(Path(sys.executable).parent / "msrun")


@pytest.mark.parametrize("positions, command", [
    # MindFormers' defaults: 8 workers on this node
    ([], expected(8, 8, "127.0.0.1", 8118, 0, "output/msrun_log", 7200)),
    (["4"], expected(4, 4, "127.0.0.1", 8118, 0, "output/msrun_log", 7200)),
    # MindFormers' README single-node example (with JOIN True)
    (["8", "8110", "output/msrun_log", "True", "7200"], expected(8, 8, "127.0.0.1", 8110, 0, "output/msrun_log", 7200)),
    # MindFormers' README multi-node example, node 3 of 32
    (["256", "8", "10.0.0.7", "8110", "3", "logs/run1", "True", "7200"],
     expected(256, 8, "10.0.0.7", 8110, 3, "logs/run1", 7200)),
    # nine arguments with LOCAL_WORKER == WORKER_NUM: one node; a negative timeout waits forever
    (["2", "2", "127.0.0.1", "9000", "0", "logs", "true", "-1"], expected(2, 2, "127.0.0.1", 9000, 0, "logs", -1)),
])
def test_each_argument_form_builds_its_msrun_command(capsys, positions, command):
    assert dry_run(capsys, TRAIN, *positions) == command


@pytest.mark.parametrize("command, script_args", [
    ("python -m training.run --config 'my runs/a.yaml'", ["-m", "training.run", "--config", "my runs/a.yaml"]),
    ("python3 training/run.py --config a.yaml", ["training/run.py", "--config", "a.yaml"]),
    # MindFormers' style: a script without the interpreter, which msrun would run with python anyway
    ("training/run.py --config a.yaml --mode 1", ["training/run.py", "--config", "a.yaml", "--mode", "1"]),
])
def test_command_forms_run_under_python(capsys, command, script_args):
    assert dry_run(capsys, command, "2") == expected(2, 2, "127.0.0.1", 8118, 0, "output/msrun_log", 7200,
                                                     script_args)


@pytest.mark.parametrize("argv, message", [
    ([TRAIN, "2", "8118"], "expected 1, 2, 6 or 9 arguments (the command first), got 3"),
    ([TRAIN, "2", "2", "127.0.0.1", "8118", "0", "logs", "True"], "expected 1, 2, 6 or 9 arguments"),
    ([TRAIN, "two"], "argument 2 (WORKER_NUM): must be a whole number, got 'two'"),
    ([TRAIN, "1"], "argument 2 (WORKER_NUM): is 1: one worker needs no msrun"),
    ([TRAIN, "0"], "argument 2 (WORKER_NUM): must be at least 1, got 0"),
    ([TRAIN, "2", "port", "logs", "True", "60"], "argument 3 (MASTER_PORT): must be a whole number, got 'port'"),
    ([TRAIN, "2", "80", "logs", "True", "60"], "argument 3 (MASTER_PORT): must be a port in 1024..65535, got 80"),
    ([TRAIN, "2", "8118", "", "True", "60"], "argument 4 (LOG_DIR): must be a directory"),
    ([TRAIN, "2", "8118", "logs", "False", "60"], "argument 5 (JOIN): must be True, got 'False'"),
    ([TRAIN, "2", "8118", "logs", "True", "0"], "argument 6 (CLUSTER_TIME_OUT): must be a number of seconds"),
    ([TRAIN, "4", "8", "10.0.0.7", "8110", "0", "logs", "True", "60"],
     "argument 3 (LOCAL_WORKER): must be between 1 and worker_num (4), got 8"),
    ([TRAIN, "8", "4", "", "8110", "0", "logs", "True", "60"], "argument 4 (MASTER_ADDR): must be a host name"),
    ([TRAIN, "8", "4", "10.0.0.7", "8110", "-1", "logs", "True", "60"],
     "argument 6 (NODE_RANK): must be 0 or more, got -1"),
    ([TRAIN, "4", "4", "10.0.0.7", "8110", "1", "logs", "True", "60"],
     "argument 6 (NODE_RANK): must be 0 when this node runs all 4 workers, got 1"),
    ([TRAIN, "8", "4", "10.0.0.7", "8110", "1", "logs", "no", "60"], "argument 8 (JOIN): must be True, got 'no'"),
    (["", "2"], "argument 1 (command): is empty"),
    (["python", "2"], "argument 1 (command): runs python with no script or module"),
    (["/usr/bin/python3 -m training.run", "2"], "argument 1 (command): starts with '/usr/bin/python3'"),
])
def test_bad_arguments_are_errors_naming_the_position(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["--dry-run", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_documents_every_form(capsys):
    with pytest.raises(SystemExit):
        launch.main(["--help"])
    text = capsys.readouterr().out
    assert 'launch "<command>" WORKER_NUM MASTER_PORT LOG_DIR JOIN CLUSTER_TIME_OUT' in text
    assert 'launch "<command>" WORKER_NUM LOCAL_WORKER MASTER_ADDR MASTER_PORT NODE_RANK' in text
    assert "MASTER_PORT 8118, NODE_RANK 0, LOG_DIR output/msrun_log, CLUSTER_TIME_OUT 7200" in text


def test_launcher_runs_msrun_with_this_interpreter_first_on_path(monkeypatch, capsys):
    """The launcher runs msrun and exits with its code (run_msrun is replaced to see what it runs)."""
    calls = []
    monkeypatch.setattr(launch, "run_msrun", lambda args, env: calls.append((args, env)) or -9)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,5")
    monkeypatch.setenv("PATH", "/usr/bin")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    with pytest.raises(SystemExit) as exited:
        launch.main([TRAIN, "2", "8200", "logs", "True", "60"])
    assert exited.value.code == 128 + 9  # killed by SIGKILL, as a shell reports it
    ((args, env),) = calls
    assert args == expected(2, 2, "127.0.0.1", 8200, 0, "logs", 60)
    assert env["PATH"] == f"{Path(sys.executable).parent}{os.pathsep}/usr/bin"
    assert shutil.which("python", path=env["PATH"]) == str(Path(sys.executable).parent / "python")
    assert env["PYTHONPATH"] == str(launch.PROJECT_ROOT)
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "4,5"
    assert f"[kiln] {shlex.join(args)}" in capsys.readouterr().err


def test_launcher_refuses_malformed_visible_devices(monkeypatch):
    monkeypatch.setattr(launch, "run_msrun", lambda *_: pytest.fail("msrun must not start"))
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0;1")
    with pytest.raises(SystemExit, match="ASCEND_RT_VISIBLE_DEVICES: must be comma-separated device ids"):
        launch.main([TRAIN, "2"])


def test_environment_keeps_the_callers_and_sets_visible_devices():
    base = {"PATH": "/bin", "PYTHONPATH": "/extra", "GLOG_v": "1", "ASCEND_RT_VISIBLE_DEVICES": "0,1"}
    env = msrun_environment(base, one_machine=True)
    assert env["PYTHONPATH"] == f"{launch.PROJECT_ROOT}{os.pathsep}/extra"
    assert env["GLOG_v"] == "1" and env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1"
    assert msrun_environment(base, "2,3", one_machine=True)["ASCEND_RT_VISIBLE_DEVICES"] == "2,3"
    assert msrun_environment({}, one_machine=True)["GLOG_v"] == "3"
    with pytest.raises(SettingError, match="lists a device twice"):
        msrun_environment({}, "0,1,0", one_machine=True)


def test_one_machine_polls_the_scheduler_within_a_second_and_a_cluster_keeps_mindspores_spread():
    polling = ("MS_RETRY_INTERVAL_LOWER", "MS_RETRY_INTERVAL_UPPER")
    assert [msrun_environment({}, one_machine=True)[k] for k in polling] == ["0", "1"]
    assert not set(polling) & set(msrun_environment({}, one_machine=False))
    assert msrun_environment({"MS_RETRY_INTERVAL_UPPER": "4"}, one_machine=True)["MS_RETRY_INTERVAL_UPPER"] == "4"


@pytest.mark.parametrize("argv, one_machine", [([TRAIN, "4"], True),
                                               ([TRAIN, "4", "2", "10.0.0.1", "8118", "1", "log", "True", "60"],
                                                False)])
def test_the_launcher_polls_fast_only_when_every_worker_is_on_this_node(monkeypatch, argv, one_machine):
    monkeypatch.delenv("MS_RETRY_INTERVAL_UPPER", raising=False)
    launched = []
    monkeypatch.setattr(launch, "run_msrun", lambda command, env: launched.append(env) or 0)
    with pytest.raises(SystemExit):
        launch.main(argv)
    assert ("MS_RETRY_INTERVAL_UPPER" in launched[0]) is one_machine


def test_settings_errors_name_the_field():
    with pytest.raises(SettingError, match="tail_worker_log: must be -1 .* below 2, got 2"):
        MsrunSettings(worker_num=2, local_worker_num=2, tail_worker_log=2)


def test_resource_builds_the_launchers_command(capsys, tmp_path):
    launched = dry_run(capsys, TRAIN, "4", "2", "10.0.0.5", "9000", "1", str(tmp_path), "True", "300")
    resource = MsrunResource(worker_num=4, local_worker_num=2, master_addr="10.0.0.5", node_rank=1,
                             cluster_time_out=300, tail_worker_log=-1)
    command = resource.command(TRAIN_ARGS, tmp_path, 9000)
    setpriv = shutil.which("setpriv")
    assert command == ([setpriv, "--pdeathsig=INT", "--"] if setpriv else []) + launched
    assert command[-len(launched):] == msrun_command(resource.settings(tmp_path, 9000), TRAIN_ARGS)


def test_resource_environment_and_errors_name_its_fields(tmp_path):
    env = MsrunResource(visible_devices="0,1,2,3").environment({"DAGSTER_PIPES_CONTEXT": "x"})
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3" and env["DAGSTER_PIPES_CONTEXT"] == "x"
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    with pytest.raises(dg.Failure, match="MsrunResource: ASCEND_RT_VISIBLE_DEVICES: must be comma-separated"):
        MsrunResource(visible_devices="all").environment({})
    with pytest.raises(dg.Failure, match=r"MsrunResource.local_worker_num: must be between 1 and worker_num \(2\)"):
        MsrunResource(worker_num=2, local_worker_num=3).command(TRAIN_ARGS, tmp_path, 9000)


def test_cluster_nodes_give_each_node_its_command(tmp_path, monkeypatch):
    monkeypatch.delenv("MS_RETRY_INTERVAL_UPPER", raising=False)
    nodes = [MsrunNode(address="10.0.0.5", devices=8, visible_devices="0,1,2,3,4,5,6,7"),
             MsrunNode(address="10.0.0.6", devices=4, visible_devices="4,5,6,7")]
    second = MsrunResource.for_node(nodes, 1, master_port=9000, device_target="Ascend")
    assert (second.worker_num, second.local_worker_num, second.master_addr) == (12, 4, "10.0.0.5")
    command = second.command(TRAIN_ARGS, tmp_path, 9000)
    assert {"--worker_num=12", "--local_worker_num=4", "--master_addr=10.0.0.5", "--master_port=9000",
            "--node_rank=1"} <= set(command)
    assert second.environment({})["ASCEND_RT_VISIBLE_DEVICES"] == "4,5,6,7"
    # a node among others keeps MindSpore's polling spread; a resource of this machine alone polls within a second
    assert "MS_RETRY_INTERVAL_UPPER" not in second.environment({})
    assert MsrunResource(worker_num=2, local_worker_num=2).environment({})["MS_RETRY_INTERVAL_UPPER"] == "1"

    with pytest.raises(dg.Failure, match=r"MsrunResource.local_worker_num: is 8 but nodes give 4 for node_rank 1"):
        MsrunResource(nodes=nodes, node_rank=1, worker_num=12, local_worker_num=8, master_addr="10.0.0.5",
                      master_port=9000).command(TRAIN_ARGS, tmp_path, 9000)
    with pytest.raises(dg.Failure, match="MsrunResource.master_port: a multi-node job needs one fixed port"):
        MsrunResource.for_node(nodes, 0, master_port=0).command(TRAIN_ARGS, tmp_path, 9000)
    with pytest.raises(dg.Failure, match=r"MsrunResource.node_rank: must index nodes \(0..1\), got 2"):
        MsrunResource.for_node(nodes, 2, master_port=9000)


def test_graph_mode_is_a_clear_error(capsys, tmp_path):
    assert train_main(["--config", str(tmp_path / "unused.yaml"), "--mode", "0"]) == 2
    assert "--mode 0: graph mode is not supported; Kiln trains in PyNative mode (--mode 1)" in capsys.readouterr().err


class FakeSession:
    def __init__(self, messages):
        self.messages = messages

    def get_custom_messages(self):
        return self.messages


def test_a_failing_message_callback_is_logged_retried_once_then_fails_the_step():
    calls = []

    def record(message):
        calls.append(message["path"])
        if message["path"] == "bad" or (message["path"] == "flaky" and calls.count("flaky") == 1):
            raise RuntimeError("database is locked")
    handler = _MessageHandler(dg.build_asset_context(), record)
    session = FakeSession([{"event": "checkpoint", "path": p} for p in ("flaky", "ok")])
    handler.drain(session)
    session.messages.append({"event": "checkpoint", "path": "bad"})
    handler.drain(session)  # only the new message
    assert calls == ["flaky", "ok", "bad"]
    with pytest.raises(dg.Failure, match="training finished.*\ncheckpoint bad: RuntimeError: database is locked$"):
        handler.retry_failed()
    assert calls == ["flaky", "ok", "bad", "flaky", "bad"]


def test_msrun_echo_drops_mindspores_info_lines_and_rank_0s_reports_which_pipes_carries():
    import io

    from resources.msrun import echo_msrun_output

    output = (
        "Start worker process with rank id:0, log file:logs/worker_0.log.\n"
        "{ step:[    1/    6], consumed_samples: 4, global_batch_size: 4, loss:   6.262437 }\n"
        "[kiln] saved checkpoint /runs/r/checkpoints/iteration_00000003\n"
        "[WARNING] ME(24788:1,MainProcess):2026-12-05-00:37:56.677.000 [mindspore/log.py:1] a warning\n"
        "Traceback (most recent call last):\n"
        "[INFO] DISTRIBUTED(24788,7eff61ffb6c0,python):2026-12-05-00:37:56.677.423 [mindspore/ccsrc/cluster/rpc/"
        "core/communicator/tcp_client.cc:367] Start] Event base dispatch success!\n"
        "[ERROR] ME(24788:1,MainProcess):2026-12-05-00:37:57.000.000 [mindspore/_api.py:365] Worker exited\n")
    for glog_v, kept in [(3, [0, 4, 6]), (2, [0, 3, 4, 6]), (1, [0, 3, 4, 5, 6])]:
        echoed = io.StringIO()
        echo_msrun_output(io.BytesIO(output.encode()), echoed, glog_v)
        assert echoed.getvalue().splitlines() == [output.splitlines()[i] for i in kept]


def test_a_msrun_killed_with_sigkill_leaves_none_of_its_processes(tmp_path):
    """run_msrun on a stand-in for msrun: a shell that starts a `tail -f` helper in its group, as msrun's join
    mode does, then waits. SIGKILL to it: the exit code says so and the helper is gone too."""
    import threading

    from test_cancel import alive

    stand_in = ["sh", "-c", f"tail -f /dev/null & echo $! > {tmp_path / 'tail.pid'}; "
                            f"echo $$ > {tmp_path / 'msrun.pid'}; exec sleep 600"]
    pids = {}

    def kill_msrun():
        while not (tmp_path / "msrun.pid").exists() or not (tmp_path / "msrun.pid").read_text().endswith("\n"):
            time.sleep(0.01)
        pids.update({name: int((tmp_path / f"{name}.pid").read_text()) for name in ("tail", "msrun")})
        os.kill(pids["msrun"], signal.SIGKILL)
    killer = threading.Thread(target=kill_msrun)
    killer.start()
    assert launch.run_msrun(stand_in, os.environ) == -signal.SIGKILL
    killer.join()
    deadline = time.monotonic() + 10
    while alive(pids["tail"]):  # SIGKILLed by run_msrun; reaped by init
        assert time.monotonic() < deadline, "the tail -f helper outlived msrun"
        time.sleep(0.01)


def test_a_launch_over_its_timeout_is_stopped_with_its_helpers(tmp_path):
    """run_msrun with a timeout: msrun (a stand-in that starts a `tail -f` helper in its group and, as msrun does,
    exits on SIGINT) gets SIGINT, the helper is killed with the group, and TimeoutError says how long it ran. (A shell
    stand-in waited out the 30 s grace in the suite, 0.56 s alone; likely an ignored SIGINT, which is inherited and
    which a shell cannot trap; msrun, like this stand-in, installs its own handler.)"""
    from test_cancel import alive

    stand_in = [sys.executable, "-c", "import signal, subprocess, sys, time\n"
                "signal.signal(signal.SIGINT, lambda *_: sys.exit(130))\n"
                "helper = subprocess.Popen(['tail', '-f', '/dev/null'])\n"
                f"open({str(tmp_path / 'tail.pid')!r}, 'w').write(str(helper.pid))\n"
                "time.sleep(600)"]
    with pytest.raises(TimeoutError, match="longer than 2 s"):  # time for the stand-in to start on a busy machine
        launch.run_msrun(stand_in, os.environ, timeout=2)
    tail = int((tmp_path / "tail.pid").read_text())
    deadline = time.monotonic() + 10
    while alive(tail):
        assert time.monotonic() < deadline, "the tail -f helper outlived the stopped launch"
        time.sleep(0.01)


def test_a_failed_local_launch_names_its_code_and_each_workers_log(tmp_path, monkeypatch):
    """run_on_local_workers (the tests' and benchmarks' launch) with msrun replaced by a shell that writes two worker
    logs and exits 3: it ran from the project root with synchronous dispatch, and LaunchFailed names both logs."""
    def stand_in(settings, script_args):
        log = Path(settings.log_dir)
        return ["sh", "-c", f"echo \"$PWD $MS_DEV_HOST_BLOCKING_RUN {' '.join(script_args)}\" > {log / 'worker_0.log'}; "
                            f"echo 'rank 1 crashing on purpose' > {log / 'worker_1.log'}; exit 3"]
    monkeypatch.setattr(launch, "msrun_command", stand_in)
    monkeypatch.delenv("MS_DEV_HOST_BLOCKING_RUN", raising=False)
    with pytest.raises(launch.LaunchFailed, match="on 2 workers exited with 3") as failed:
        launch.run_on_local_workers(["case.py", tmp_path], tmp_path / "log", 2)
    assert f"{launch.PROJECT_ROOT} 1 case.py {tmp_path}" in str(failed.value)
    assert "worker_1.log\nrank 1 crashing on purpose" in str(failed.value)
