"""`nanokv router`: one front for N replicas (a replica is a gateway with its cache and compute),
routing each request where its prefix is cached (docs/router.md). No torch: it hashes and forwards."""
