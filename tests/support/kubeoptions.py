"""The daemon's Kubernetes options for tests on the emulated API server, and the bound of waits.

Short backoffs (the tests' waits), and bounds that only end a hang: a request to the local
emulator, a GCS call or the caches' first lists take milliseconds, but more than 2 s on a
machine whose two cores serve four pytest processes and a busy neighbour (a 403 test once failed
on its 2 s request timeout there; run 31 lost a GCS claim test on the 5 s connect bound of
a ``RayGcs`` client, so the tests' ``RayGcs`` clients of live clusters take this bound too).
A test about a timeout sets its own, short one.
"""

from __future__ import annotations

from resilienced.kube.cache import CacheOptions
from resilienced.kube.cluster import KubeOptions

#: The bound of a wait for something local to happen (a watch event, a write, a request): a wait
#: on a condition ends as soon as it holds, so the bound only ends a hang and can be generous.
LOCAL_BOUND_S = 30.0

FAST = KubeOptions(
    cache=CacheOptions(request_timeout_s=LOCAL_BOUND_S, watch_timeout_s=30, backoff_initial_s=0.05,
                       backoff_max_s=0.2),
    ready_timeout_s=LOCAL_BOUND_S,
    request_timeout_s=LOCAL_BOUND_S,
    gcs_timeout_s=LOCAL_BOUND_S,
)
