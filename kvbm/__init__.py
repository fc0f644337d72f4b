"""KV Block Manager: tiered KV block storage (G1 device .. G4 Redis) and the index of who holds which block."""
