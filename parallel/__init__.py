"""How work spreads over devices (meshes, PCP, DCP, EP). Built by the context-parallelism issue."""
