"""Ray starts a local cluster and runs a task and an actor made with ray.remote at the call site."""

import os

import pytest

pytestmark = pytest.mark.slow


class Counter:
    def __init__(self):
        self.count = 0

    def add(self, n):
        self.count += n
        return self.count


def test_local_cluster_runs_task_and_actor():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        square = ray.remote(num_cpus=1)(lambda x: (x * x, os.getpid()))
        results = ray.get([square.remote(i) for i in range(4)])
        assert [r[0] for r in results] == [0, 1, 4, 9]
        assert all(pid != os.getpid() for _, pid in results)  # ran in worker processes

        counter = ray.remote(num_cpus=1)(Counter).remote()
        assert ray.get([counter.add.remote(1) for _ in range(3)]) == [1, 2, 3]
        assert ray.cluster_resources()["CPU"] == 2
    finally:
        ray.shutdown()
