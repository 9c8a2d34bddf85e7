"""Environment tables: Slurm node lists, cluster detection, per-process settings."""

import warnings
from datetime import timedelta

import pytest

from fastddp.cluster import (
    ClusterError,
    detect_kind,
    expand_nodelist,
    launcher_settings,
    process_settings,
    slurm_port,
    unread,
)
from fastddp.watchdog import peer_timeout_from_env


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("gpu5", ["gpu5"]),
        ("gpu[07-08]", ["gpu07", "gpu08"]),
        ("node[01-04,07],gpu5", ["node01", "node02", "node03", "node04", "node07", "gpu5"]),
        ("a[8-11]", ["a8", "a9", "a10", "a11"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("x1,x2", ["x1", "x2"]),
        (" x1, x2", ["x1", "x2"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "bad,message",
    [
        ("gpu[01-", "unbalanced '\\['"),
        ("gpu[3-1]", "runs backwards"),
        ("gpu[a-b]", "bad range"),
        (",", "names no host"),  # (an IndexError where its first host was read)
        (" ", "names no host"),
    ],
)
def test_malformed_nodelist(bad, message):
    with pytest.raises(ClusterError, match=message):
        expand_nodelist(bad)


def test_slurm_port_is_stable_and_outside_ephemeral_range():
    assert slurm_port("123456") == slurm_port("123456")
    assert 20000 <= slurm_port("987654321") < 30000
    assert slurm_port("1") != slurm_port("2")
    # Steps of one job run at once (srun ... & srun ...) get ports of their own; the job's
    # first step keeps the job's.
    assert slurm_port("7", "1") != slurm_port("7", "0") == slurm_port("7")
    assert slurm_port("7", "batch") == slurm_port("7")


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]"}


def test_slurm_launcher_settings():
    kind, s = launcher_settings({**SLURM, "SLURM_NODEID": "1", "SLURM_GPUS_ON_NODE": "4"})
    assert kind == "slurm"
    assert s["nnodes"].value == "2" and s["node_rank"].value == 1
    assert s["master_addr"].value == "gpu07"
    assert s["master_port"].value == slurm_port("4242")
    assert s["nproc_per_node"].value == "4"
    # Without Slurm's GPU count, the GPUs visible on the node decide.
    _, s = launcher_settings({**SLURM, "SLURM_NODEID": "0"}, gpus_on_node=8)
    assert s["nproc_per_node"] == ("8", "GPUs visible on this node")
    # Explicit MASTER_ADDR/MASTER_PORT win over what Slurm implies.
    _, s = launcher_settings({**SLURM, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"})
    assert s["master_addr"] == ("10.0.0.5", "MASTER_ADDR") and s["master_port"].value == 1234


def test_srun_with_several_tasks_per_node_is_refused():
    env = {**SLURM, "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}
    with pytest.raises(ClusterError, match="srun started 4 tasks per node"):
        launcher_settings(env)
    # One task per node is the supported shape.
    launcher_settings({**SLURM, "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"})


# Every setting detection decides, given elsewhere (the command line, or --standalone).
ALL_GIVEN = {"nnodes", "node_rank", "master_addr", "master_port"}


def test_several_launchers_a_node_are_the_users_where_nothing_is_read():
    # An interactive srun -n8 --pty bash runs one launcher, with --standalone or every setting
    # on the command line: nothing read from Slurm or mpirun, nothing refused.
    srun = {**SLURM, "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}
    mpi = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}  # fmt: skip
    for env in (srun, mpi):
        launcher_settings(env, given=ALL_GIVEN)
        for left in ALL_GIVEN:  # one read from the environment: refused, with the ways out
            with pytest.raises(ClusterError, match="per node") as e:
                launcher_settings(env, given=ALL_GIVEN - {left})
            assert "--cluster none to read no" in str(e.value), e.value
    fix = r"4 tasks per node \(SLURM_STEP_TASKS_PER_NODE=4\(x2\)\).*pass --standalone, or --cl"
    with pytest.raises(ClusterError, match=fix):
        launcher_settings(srun)
    with pytest.raises(ClusterError, match="master.*, or pass --cluster none"):
        launcher_settings({"PMI_SIZE": "2", "PMI_RANK": "0"})


def test_srun_preserve_env_counts_the_steps_tasks():
    # srun -E (--preserve-env) keeps the allocation's SLURM_NTASKS and SLURM_NNODES (16 tasks
    # on 2 nodes); the step runs 2, one a node: only the SLURM_STEP_* counts are the step's.
    step = {
        "SLURM_JOB_ID": "900",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "1",
        "SLURM_NODEID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "16",
        "SLURM_NNODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_STEP_NODELIST": "gpu[01-02]",
    }
    _, s = process_settings(step)
    assert s["world_size"] == (2, "SLURM_STEP_NUM_TASKS") and s["local_world_size"].value == 1
    # srun --mpi=pmi2 sets PMI_SIZE to the step's tasks: srun's, not an mpirun's ranks.
    pmi = {**step, "PMI_RANK": "1", "PMI_SIZE": "2"}
    assert detect_kind(pmi) == "slurm"
    assert process_settings(pmi)[1]["world_size"].value == 2
    assert launcher_settings(pmi)[1]["nnodes"] == ("2", "SLURM_STEP_NUM_NODES")


def test_xtuner_variables_are_read_all_or_none():
    # Under Slurm and mpirun their own variables (and MASTER_*) decide: none of XTuner's is
    # read, its ADDR and PORT included, and unread() names them for the launcher to say so.
    xtuner = {"NNODES": "1", "NODE_RANK": "0", "NPROC_PER_NODE": "2", "ADDR": "127.0.0.1",
              "PORT": "29601"}  # fmt: skip
    slurm = {**SLURM, "SLURM_NODEID": "1", "SLURM_GPUS_ON_NODE": "4"}
    mpi = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "MASTER_ADDR": "h0"}
    for env, master in ((slurm, ("gpu07", slurm_port("4242"))), (mpi, ("h0", None))):
        kind, s = launcher_settings({**env, **xtuner})
        got = {key: setting.value for key, setting in s.items()}
        assert got["nnodes"] == "2" and got["node_rank"] == 1, got
        assert (got["master_addr"], got.get("master_port")) == master, got
        assert got.get("nproc_per_node") in (None, "4"), got  # Slurm's GPUs, or none
        assert unread({**env, **xtuner}, kind) == [f"{k}={v}" for k, v in xtuner.items()]
    # Nor by a rank started by srun, which says so.
    task = {**SRUN, "ADDR": "127.0.0.1", "NNODES": "2"}
    with pytest.warns(UserWarning, match="ADDR=127.0.0.1: XTuner's variables are not read"):
        assert process_settings(task)[1]["master_addr"].value == "n1"
    # Alone, all of them are read (test_xtuner_and_plain_variables), and nothing is unread.
    assert unread(xtuner, "env") == [] and launcher_settings(xtuner)[0] == "env"


def test_a_slurm_step_on_some_nodes_counts_its_own():
    # srun -N1 -w gpu08 in an allocation of two nodes made with --ntasks-per-node=8: the
    # step's node 0 is gpu08, and it runs one task per node.
    step = {
        **SLURM,
        "SLURM_STEP_ID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NTASKS_PER_NODE": "8",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NODELIST": "gpu08",
        "SLURM_STEP_TASKS_PER_NODE": "1",
    }
    _, s = launcher_settings(step)
    assert s["nnodes"] == ("1", "SLURM_STEP_NUM_NODES") and s["master_addr"].value == "gpu08"
    task = {**step, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}
    assert process_settings(task)[1]["master_addr"].value == "gpu08"


def test_settings_given_elsewhere_are_neither_required_nor_read():
    mpi = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}
    for given in ({"master_addr"}, {"rdzv_endpoint"}):
        assert launcher_settings(mpi, given=given)[0] == "mpi"
    # What Kubernetes sets for a service named "master".
    k8s = {"MASTER_ADDR": "h", "MASTER_PORT": "tcp://10.96.0.5:29500"}
    with pytest.raises(ClusterError, match="is not an integer; pass --master-port"):
        launcher_settings(k8s)
    assert launcher_settings(k8s, given={"master_port"})[1]["master_port"].source == "MASTER_PORT"


def test_is_main_process_before_the_group(monkeypatch):
    import torch.distributed as dist

    import fastddp

    assert not dist.is_initialized()
    for name in ("RANK", "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    assert fastddp.is_main_process()  # not in a job
    for env, main in (
        ({"RANK": "1"}, False),
        ({"RANK": "0"}, True),
        ({"SLURM_PROCID": "2", "SLURM_STEP_ID": "0"}, False),
        ({"OMPI_COMM_WORLD_RANK": "3"}, False),
        # mpirun's rank 3 on the first node of an allocation, with its daemon's SLURM_PROCID.
        (
            {
                "SLURM_PROCID": "0",
                "SLURM_STEP_ID": "0",
                "SLURM_NTASKS": "2",
                "OMPI_COMM_WORLD_RANK": "3",
                "OMPI_COMM_WORLD_SIZE": "8",
            },
            False,
        ),
    ):
        with monkeypatch.context() as m:
            for name, value in env.items():
                m.setenv(name, value)
            assert fastddp.is_main_process() is main, env


def test_xtuner_and_plain_variables():
    env = {"NNODES": "3", "NODE_RANK": "2", "NPROC_PER_NODE": "8", "ADDR": "h0", "PORT": "29601"}
    kind, s = launcher_settings(env)
    assert kind == "env"
    assert {k: v.value for k, v in s.items()} == {
        "nnodes": "3",
        "node_rank": 2,
        "nproc_per_node": "8",
        "master_addr": "h0",
        "master_port": 29601,
    }
    _, s = launcher_settings({"MASTER_ADDR": "h1", "MASTER_PORT": "5"})
    assert s["master_addr"].value == "h1" and s["master_port"].value == 5
    assert launcher_settings({}) == ("none", {})
    # ADDR and PORT alone (a web server's PORT) are not XTuner's: not read.
    assert launcher_settings({"PORT": "8080", "ADDR": "0.0.0.0"}) == ("none", {})
    _, s = launcher_settings({"PORT": "8080", "MASTER_PORT": "5"})
    assert s["master_port"].value == 5 and s["master_port"].source == "MASTER_PORT"


def test_mpi_launcher_settings():
    env = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "MASTER_ADDR": "m"}
    kind, s = launcher_settings(env)
    assert kind == "mpi" and s["nnodes"].value == "4" and s["node_rank"].value == 3
    with pytest.raises(ClusterError, match="export MASTER_ADDR"):
        launcher_settings({"PMI_SIZE": "2", "PMI_RANK": "0"})
    # XTuner's ADDR alone is no master: it passed here, and the nodes met on loopback.
    with pytest.raises(ClusterError, match="export MASTER_ADDR"):
        launcher_settings({"PMI_SIZE": "2", "PMI_RANK": "0", "ADDR": "10.0.0.1"})
    with pytest.raises(ClusterError, match="mpirun started 2 processes per node"):
        launcher_settings({**env, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    # Intel MPI's or MPICH's mpirun inside a Slurm allocation: its ranks inherit the SLURM_*
    # of the srun step that started its daemons, one a node; they are mpirun's ranks.
    hydra = {"PMI_SIZE": "16", "PMI_RANK": "3", "MPI_LOCALNRANKS": "8", "MASTER_ADDR": "m"}
    step = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    with pytest.raises(ClusterError, match="mpirun started 8 processes per node"):
        launcher_settings({**hydra, **step, "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "2"})
    # srun --mpi=pmi2 sets PMI_SIZE too, to its own number of tasks: a Slurm launch.
    srun = {**step, "PMI_SIZE": "2", "PMI_RANK": "0", "SLURM_JOB_NUM_NODES": "2"}
    assert (
        launcher_settings({**srun, "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "a,b"})[0] == "slurm"
    )


def test_every_mpis_local_rank_and_size_are_read():
    # HPE Cray PALS' and MVAPICH2's names beside Open MPI's and Hydra's: each rank its own
    # device, and several launchers a node refused.
    pals = {"PMI_RANK": "5", "PMI_SIZE": "8", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "4"}
    mv2 = {"PMI_RANK": "5", "PMI_SIZE": "8", "MV2_COMM_WORLD_LOCAL_RANK": "1",
           "MV2_COMM_WORLD_LOCAL_SIZE": "4"}  # fmt: skip
    for env in (pals, mv2):
        env = {**env, "MASTER_ADDR": "m"}
        _, s = process_settings(env)
        assert (s["local_rank"].value, s["local_world_size"].value) == (1, 4), s
        with pytest.raises(ClusterError, match="mpirun started 4 processes per node"):
            launcher_settings(env)
    # No variable names the local rank: 0, as for one rank a node, said in a warning.
    with pytest.warns(UserWarning, match="no variable names this rank's index on its node"):
        _, s = process_settings({"PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_ADDR": "m"})
    assert s["local_rank"] == (0, "default 0")


def test_forced_kind_without_its_variables():
    with pytest.raises(ClusterError, match="not in a Slurm job"):
        launcher_settings({}, "slurm")
    with pytest.raises(ClusterError, match="unknown cluster kind"):
        launcher_settings({}, "pbs")


PLAIN = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="h", MASTER_PORT="29500")
SRUN = {
    "SLURM_JOB_ID": "7",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
}
MPI = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "MASTER_ADDR": "m"}


@pytest.mark.parametrize(
    "env,source,want",
    [
        (PLAIN, "env", {"rank": 1, "world_size": 2, "master_port": 29500}),
        ({**PLAIN, "TORCHELASTIC_RUN_ID": "x", "GROUP_RANK": "0"}, "torchrun", {"node_rank": 0}),
        (SRUN, "slurm", {"rank": 5, "world_size": 8, "local_rank": 1, "local_world_size": 4}),
        (SRUN, "slurm", {"master_addr": "n1", "master_port": slurm_port("7")}),
        ({**MPI, "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, "mpi", {"rank": 2, "master_port": 29500}),
        # mpirun inside an allocation: its daemons are srun's tasks, one a node, and the ranks
        # inherit a daemon's SLURM_PROCID and SLURM_NTASKS (2 nodes here, 4 ranks).
        (
            {**SRUN, "SLURM_NTASKS": "2", **MPI, "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
            "mpi",
            {"rank": 2, "world_size": 4, "local_rank": 0},
        ),
        # The same with as many ranks as the step has tasks (4 nodes, 2 ranks on each of 2):
        # Open MPI's variables are its mpirun's alone, whatever the sizes.
        (
            {**SRUN, "SLURM_NTASKS": "4", **MPI, "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
            "mpi",
            {"rank": 2, "world_size": 4, "local_rank": 1},
        ),
        # A step of uneven nodes: this node's number of tasks, not the largest.
        (
            {**SRUN, "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1"},
            "slurm",
            {"local_world_size": 1, "node_rank": 2},
        ),
        # srun --mpi=pmi2 launching an MPI program: the same ranks both ways, Slurm's kept.
        ({**SRUN, "PMI_RANK": "5", "PMI_SIZE": "8"}, "slurm", {"rank": 5, "local_rank": 1}),
        # Two steps of one job at once: ports of their own.
        ({**SRUN, "SLURM_STEP_ID": "1"}, "slurm", {"master_port": slurm_port("7", "1")}),
        ({}, "single", {"rank": 0, "world_size": 1, "local_rank": 0}),
    ],
)
def test_process_settings_tables(env, source, want):
    found, settings = process_settings(env)
    assert found == source
    assert {key: settings[key].value for key in want} == want


def test_a_batch_script_of_several_tasks_is_warned_that_it_runs_alone():
    # python train.py in an sbatch script of 4 tasks, srun forgotten: one process, rank 0 of 1.
    batch = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}
    with pytest.warns(UserWarning, match=r"SLURM_NTASKS=4, but this process is no srun task"):
        assert process_settings(batch)[0] == "single"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        process_settings({**batch, "SLURM_NTASKS": "1"})  # one task: nothing to say
        process_settings({})


def test_process_settings_errors():
    for env, missing in (
        ({"RANK": "1", "LOCAL_RANK": "1"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2"}, "RANK"),
    ):
        with pytest.raises(ClusterError, match=f"is set but {missing} is not; export RANK"):
            process_settings({**env, "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    with pytest.raises(ClusterError, match="LOCAL_RANK is not"):
        process_settings({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    with pytest.raises(ClusterError, match="MASTER_ADDR/MASTER_PORT are not"):
        process_settings({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(ClusterError, match="RANK='x' is not an integer"):
        process_settings({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(ClusterError, match="MASTER_ADDR is not set"):
        process_settings({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})


def test_more_environment_errors():
    with pytest.raises(ClusterError, match="no OMPI_COMM_WORLD_\\* or PMI_\\* variables"):
        launcher_settings({}, "mpi")
    srun = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
    with pytest.raises(ClusterError, match="srun task without SLURM_JOB_NODELIST or MASTER_ADDR"):
        process_settings(srun)
    del srun["SLURM_NTASKS"]
    with pytest.raises(ClusterError, match="SLURM_NTASKS is not set"):
        process_settings({**srun, "SLURM_JOB_NODELIST": "n1"})


@pytest.mark.parametrize(
    "raw, world, want",
    [
        (None, 2, 300.0),
        (None, 65, 0.0),
        ("0", 2, 0.0),
        ("0.0", 2, 0.0),
        ("2.5", 65, 2.5),
        ("1", 2, 1.0),
    ],
)
def test_peer_timeout_from_env(raw, world, want):
    env = {} if raw is None else {"FASTDDP_PEER_TIMEOUT": raw}
    assert peer_timeout_from_env(env, world) == want


@pytest.mark.parametrize(
    "raw, message",
    [
        ("abc", "is not a number of seconds"),
        ("-1", "must be 0 \\(off\\)"),
        ("nan", "must be 0 \\(off\\) or a positive, finite number"),
        # Under a second the watchdog named busy ranks lost; 1e-400 read as 0, off.
        ("0.001", "is shorter than 1 s, the least the watchdog takes; use 0 to turn it off"),
        ("1e-400", "is shorter than 1 s, the least the watchdog takes"),
    ],
)
def test_a_bad_peer_timeout_is_refused_by_the_worker_before_any_group(raw, message):
    # What a worker under plain torchrun meets (fastddp.launch refuses it before starting one);
    # alone here: with other ranks, every rank raises it (test_launch.py).
    import torch.distributed as dist

    import fastddp

    env = {"FASTDDP_PEER_TIMEOUT": raw}
    with pytest.raises(ClusterError, match=f"FASTDDP_PEER_TIMEOUT='{raw}' {message}"):
        fastddp.init_distributed(backend="gloo", environ=env)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"peer_timeout": "60"}, "peer_timeout must be a number of seconds, .* got '60'"),
        ({"peer_timeout": -1.0}, "0 \\(off\\) or positive and finite, got -1.0"),
        # (inf overflowed in the watchdog, after the group was made: a group left behind)
        ({"peer_timeout": float("inf")}, "0 \\(off\\) or positive and finite, got inf"),
        ({"peer_timeout": 0.25}, "peer_timeout=0.25 is shorter than 1 s, the least the watchdog"),
        ({"timeout": 30}, "timeout must be a datetime.timedelta, got int"),
        ({"timeout": timedelta(0)}, "timeout must be positive, got 0:00:00"),
        ({"backend": "glo"}, "unknown backend 'glo'; use 'nccl' \\(GPUs\\) or 'gloo' \\(CPU\\)"),
        # (a device's part failed an assert in torch)
        ({"backend": "cpu:glooo"}, "unknown backend 'cpu:glooo'; use 'nccl'"),
        ({"backend": "cpu:gloo,cuda:"}, "unknown backend 'cpu:gloo,cuda:'"),
        # (a device torch does not know, or a space, failed in torch after the rendezvous)
        ({"backend": "gpu:gloo"}, "unknown backend 'gpu:gloo'"),
        ({"backend": "cpu:gloo, cuda:nccl"}, "unknown backend 'cpu:gloo, cuda:nccl'"),
        ({"environ": {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"}},
         "MASTER_PORT=99999 is not a TCP port; give one from 1 to 65535"),
    ],
)  # fmt: skip
def test_bad_init_arguments_are_refused_before_any_group(kwargs, message):
    import torch.distributed as dist

    import fastddp

    env = {}  # alone: with other ranks, every rank raises it (test_launch.py)
    with pytest.raises((ClusterError, TypeError, ValueError), match=message):
        fastddp.init_distributed(**{"backend": "gloo", "environ": env, **kwargs})
    assert not dist.is_initialized()


def test_a_backend_is_named_as_torch_names_it():
    import torch.distributed as dist

    import fastddp

    env = {}
    try:
        assert fastddp.init_distributed(backend="Gloo", environ=env).backend == "gloo"
        assert fastddp.init_distributed(backend="GLOO", environ=env).backend == "gloo"
        assert dist.get_backend() == "gloo"
    finally:
        fastddp.shutdown_distributed()


def test_a_later_call_refuses_arguments_it_would_ignore():
    import fastddp

    env = {}
    try:
        fastddp.init_distributed(timeout=timedelta(seconds=90), environ=env, peer_timeout=0)
        # Given again as they were, or not given: the same description. One process runs no
        # watchdog, so any valid peer_timeout is as good as another.
        same = fastddp.init_distributed(backend="gloo", timeout=timedelta(seconds=90))
        assert same is fastddp.init_distributed(peer_timeout=30) is fastddp.init_distributed()
        for kwargs, message in [
            ({"timeout": timedelta(seconds=1)}, "timeout=datetime.timedelta\\(seconds=90\\), not"),
            ({"peer_timeout": -5}, "peer_timeout must be a number of seconds, 0 \\(off\\)"),
            ({"backend": "nccl"}, "already initialised with backend='gloo', not 'nccl'"),
        ]:
            with pytest.raises(ClusterError, match=message):
                fastddp.init_distributed(**kwargs)
    finally:
        fastddp.shutdown_distributed()


def test_a_variable_set_elsewhere_is_not_read():
    # The command line (or PET_*) covers these: a malformed value is no error, and is kept as
    # text only for the launcher's "command line wins over ..." line.
    bad = {"SLURM_JOB_ID": "1", "SLURM_NNODES": "abc", "SLURM_NODEID": "x",
           "SLURM_NODELIST": "node[01-03", "SLURM_GPUS_ON_NODE": "y"}  # fmt: skip
    with pytest.raises(ClusterError, match="SLURM_NNODES='abc' is not an integer"):
        launcher_settings(bad)
    given = {"nnodes", "node_rank", "master_addr", "nproc_per_node"}
    _, s = launcher_settings(bad, given=given)
    assert s["nnodes"] == ("abc", "SLURM_NNODES") and s["node_rank"] == ("x", "SLURM_NODEID")
    assert s["master_addr"] == ("node[01-03", "SLURM_NODELIST")
    assert s["nproc_per_node"] == ("y", "SLURM_GPUS_ON_NODE")
    mpi = {"OMPI_COMM_WORLD_SIZE": "two", "OMPI_COMM_WORLD_RANK": "1", "MASTER_ADDR": "h"}
    assert launcher_settings(mpi, given={"nnodes"})[1]["nnodes"].value == "two"


def test_a_job_without_gpus_leaves_the_process_count_alone():
    _, s = launcher_settings({**SLURM, "SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": "0"})
    assert "nproc_per_node" not in s


def test_a_devices_nccl_takes_a_gpu_a_rank():
    # 'cpu:gloo,cuda:nccl' (what the backend message suggests) put every rank on the CPU: only
    # 'nccl' took a GPU. The cuda part decides.
    from fastddp._init_args import uses_nccl

    assert uses_nccl("nccl") and uses_nccl("cuda:nccl") and uses_nccl("cpu:gloo,cuda:nccl")
    assert not uses_nccl("gloo") and not uses_nccl("cpu:gloo") and not uses_nccl("cuda:gloo")
