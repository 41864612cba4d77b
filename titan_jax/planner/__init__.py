"""The TPU planner: what a step costs on a slice, without the slice.

`topology` (chips and slices by their Cloud names, compile-only devices), `aot_compile` (the
step compiled ahead of time for a slice, on this CPU with libtpu: `titan-jax compile`),
`inspect_step` (the compiled step's shardings, memory and collectives: `titan-jax inspect`),
and the estimate from the compiled program: `hlo_stats` (HLO parsing), `kernel_flops`
(Pallas kernels' work), `mxu_work`, `collectives`, `sustained` (the chips' published
sustained rates) and `hlo_cost` (the cost model), and `calibration` (the cost model against
published hardware step times: the band every estimate carries). It sits
above `train/` (it builds trainers to compile them) and beside `tools/`; its tests are in
tests/planner/.
"""
