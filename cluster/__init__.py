"""What every part of a Strata cluster shares, beside `server` and `kvbm` and imported by both (it imports
neither):

    cluster.secret        the cluster secret (`load_secret`, `check_secret`) and one key per purpose (`derive_key`)
    cluster.curve         CURVE keys from the secret and the ZAP check: the scheme of every ZMQ link over TCP
    cluster.backoff       `Backoff`: the one doubling backoff (Redis reconnects, G5's breaker, rank-group restarts)
    cluster.redis_link    `RedisLink`: a Redis client that never raises into its caller, with backoff
    cluster.redis_lease   `Leases`: Redis leases and claims renewed and released only by their holder (Lua)
"""
