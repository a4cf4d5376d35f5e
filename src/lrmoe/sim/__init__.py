"""Virtual EP emulator: G expert-parallel ranks of one MoE layer in one process, with
per-rank kernel times and modelled link times (docs/design.md §9). Results are *emulated*."""
