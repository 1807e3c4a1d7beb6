"""`python -m ddp_recipes.doctor`: PASS on 2 CPU processes (spawned and under torchrun), and each pre-flight
failure stops before any process starts, with its cause and fix. No timing is asserted."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from ddp_recipes.doctor.checks import COMM_VARS, classify, ifname_problem, is_loopback
from ddp_recipes.doctor.cli import main
from ddp_recipes.doctor.config import TORCHRUN_VARS, DoctorConfig, parse_bytes
from ddp_recipes.doctor.sweep import bus_bandwidth, sweep_sizes
from tests import launch
from tests.helpers import free_port

# The test's environment minus anything that would make the doctor think torchrun started it; its own
# warnings settings; one thread per rank (the cores are shared: stay small).
PLAIN = dict(drop=TORCHRUN_VARS + COMM_VARS, port=False, quiet=None)


@pytest.fixture(autouse=True)
def plain_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_VARS + COMM_VARS:
        monkeypatch.delenv(name, raising=False)


def test_sizes_and_bus_bandwidth_follow_nccl_tests() -> None:
    assert parse_bytes("64M") == parse_bytes("64MiB") == 64 << 20
    assert parse_bytes("4096") == 4096 and parse_bytes("lots") is None
    assert sweep_sizes(64 << 20) == [4 << 10 << 2 * i for i in range(8)]  # 4K, 16K, ... 64M
    assert sweep_sizes(100 << 10) == [4 << 10, 16 << 10, 64 << 10]
    assert bus_bandwidth(10.0, 2) == 10.0 and bus_bandwidth(8.0, 4) == 12.0
    assert all(map(is_loopback, ["127.0.0.1", "127.0.1.1", "localhost", "::1"]))
    assert not any(map(is_loopback, ["10.0.0.1", "node-0"]))


@pytest.mark.parametrize("argv, flag_name", [
    (["--devices", "0"], "--devices"),
    (["--num-nodes", "2", "--node-rank", "2"], "--node-rank"),
    (["--master-port", "70000"], "--master-port"),
    (["--backend", "nccl", "--accelerator", "cpu"], "--backend nccl"),
    (["--max-bytes", "1K"], "--max-bytes"),
    (["--timeout-s", "0"], "--timeout-s"),
])
def test_bad_flags_exit_2_naming_the_flag(argv: list[str], flag_name: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert flag_name in err and len(err.splitlines()) == 1


def test_more_devices_than_gpus_exits_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit) as exc:
        main(["--accelerator", "cuda", "--devices", "2"])
    assert exc.value.code == 2 and "--devices 2 but only 1 CUDA GPU" in capsys.readouterr().err


def test_flags_that_contradict_torchrun_exit_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    for name, value in dict(TORCHELASTIC_RUN_ID="test", RANK="0", WORLD_SIZE="2", LOCAL_RANK="0",
                            LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29512").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exc:
        main(["--accelerator", "cpu", "--devices", "3"])
    assert exc.value.code == 2 and "--devices 3 disagrees with torchrun's --nproc-per-node 2" in capsys.readouterr().err


def test_port_in_use_fails_before_spawning(capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["--devices", "2", "--accelerator", "cpu", "--master-port", str(port)])
    out = capsys.readouterr().out
    assert code == 1
    assert f"FAIL: port {port} on 127.0.0.1 is in use" in out and "--master-port <free port>" in out


@pytest.mark.parametrize("node_rank", ["0", "1"])
def test_loopback_master_with_two_nodes_fails_without_waiting(node_rank: str, capsys: pytest.CaptureFixture) -> None:
    code = main(["--num-nodes", "2", "--node-rank", node_rank, "--master-addr", "127.0.0.1",
                        "--master-port", str(free_port()), "--accelerator", "cpu", "--timeout-s", "600"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL: MASTER_ADDR=127.0.0.1 with --num-nodes 2: other nodes cannot reach loopback" in out
    assert "--master-addr <node-0 IP/hostname" in out


def test_unknown_socket_ifname_fails_and_lists_interfaces(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "nosuchnic7")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    assert main(["--accelerator", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "NCCL_DEBUG=INFO" in out  # the set variables are listed
    assert "FAIL: NCCL_SOCKET_IFNAME=nosuchnic7 names no interface" in out
    assert socket.if_nameindex()[0][1] in out
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", socket.if_nameindex()[0][1][:2])  # NCCL matches prefixes
    assert ifname_problem("NCCL_SOCKET_IFNAME", [n for _, n in socket.if_nameindex()]) is None


def test_init_errors_map_to_causes() -> None:
    cfg = DoctorConfig(accelerator="cpu", master_port=29511)
    in_use = RuntimeError("The server socket has failed to listen on any local network address. port: 29511, "
                          "code: -98, name: EADDRINUSE, message: address already in use")
    assert "port 29511 on 127.0.0.1 is in use" in classify(in_use, cfg, "init", 0).cause
    timeout = RuntimeError("Timed out after 61 seconds waiting for clients. 1/2 clients joined.")
    assert "rendezvous at 127.0.0.1:29511 timed out" in classify(timeout, cfg, "init", 0).cause
    lost = classify(RuntimeError("Connection closed by peer [127.0.0.1]:1234"), cfg, "bandwidth", 1)
    assert lost.secondary and "rank 1 lost a peer" in lost.cause


@pytest.mark.timeout(240)
def test_two_cpu_processes_pass_and_write_json(tmp_path: Path) -> None:
    report_path = tmp_path / "doctor.json"
    run = launch.run(["-m", "ddp_recipes.doctor", "--devices", "2", "--accelerator", "cpu", "--max-bytes", "1M",
                      "--json", str(report_path)], timeout=200, **PLAIN)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().splitlines()[-1] == "PASS"
    report = json.loads(report_path.read_text())
    assert report["result"] == "PASS" and report["world_size"] == 2
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert all(r["backend"] == "gloo" and r["all_reduce_ok"] and r["broadcast_ok"] for r in report["ranks"])
    rows = report["bandwidth"]
    assert [r["bytes"] for r in rows] == [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]
    for row in rows:
        assert row["time_us"] > 0
        assert row["algbw_gbs"] == pytest.approx(row["bytes"] / (row["time_us"] * 1e-6) / 1e9)
        assert row["busbw_gbs"] == pytest.approx(row["algbw_gbs"] * 2 * (2 - 1) / 2)


@pytest.mark.timeout(240)
def test_passes_under_torchrun() -> None:
    run = launch.run(["-m", "ddp_recipes.doctor", "--accelerator", "cpu", "--max-bytes", "64K"], timeout=200,
                     torchrun=2, **{**PLAIN, "port": free_port()})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PASS" in run.stdout.splitlines()
    assert "(torchrun)" in run.stdout and run.stdout.count("\n   1     1     2  gloo") == 1


def test_a_hung_nccl_collective_is_diagnosed_not_an_exit_code() -> None:
    """Under blocking wait (the doctor sets it on NCCL) torch raises this from the rank's own thread."""
    cfg = DoctorConfig(accelerator="cpu", master_port=29511, timeout_s=30)
    hung = RuntimeError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, "
                        "OpType=ALLREDUCE, NumelIn=65537, NumelOut=65537, Timeout(ms)=30000) ran for 30010 "
                        "milliseconds before timing out.")
    found = classify(hung, cfg, "check", 0)
    assert found.secondary
    assert found.cause.startswith("rank 0: a collective in the check step hung for --timeout-s 30 s")
