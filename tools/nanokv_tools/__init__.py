"""nanokv's tools: benchmarks (bench/), the trace simulator (sim/) and the quality evaluation (eval/).

A separate distribution (tools/pyproject.toml): the engine never imports it; `nanokv bench`,
`nanokv simulate` and `nanokv eval` load it when it is installed."""
