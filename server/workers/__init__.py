"""Workers: an engine in its own process (spawned by the server, or `strata worker` on any host) and the
server's side of the link to it. Imports the engine protocol and kvbm; never the router or the frontend.

    protocol.py  every message between the server and a worker (typed msgspec Structs, no pickle), WorkerInfo,
                 WorkerId, WorkerStats
    transport.py Channel: ZMQ PUSH/PULL between the server and one worker (ipc, or TCP bound by a remote worker)
    worker.py    the worker process (engine behind the channel), WorkerSpec, build_llm_engine
    hardware.py  HardwareInfo and calibrated Speeds a worker reports in its hello
    remote.py    RemoteEngine: the Engine Protocol over a spawned or connected worker; spawn_workers
    registry.py  remote workers in Redis: Registration (worker side), Directory (server side), key layout
    discovery.py Discovery: adds the remote workers that register for a model to a WorkerPool (the RoutedEngine)
    remote_worker.py  `strata worker`: one engine serving one claimed server at a time
"""
