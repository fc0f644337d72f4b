"""`python -m kvbm --redis-url redis://host:6379/0`: the standalone KVBM service (what `strata kvbm` runs)."""

from kvbm.cli import main

if __name__ == "__main__":
    main()
