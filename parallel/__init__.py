"""How work spreads over devices: meshes and multi-host start-up (`mesh`, `launch`), prefill context
parallelism (`pcp`), decode context parallelism (`dcp`), the cache a rank sees inside the model
(`cp_cache`) and one attention layer run through it (`layers`), expert parallelism (`ep`), communication
accounting (`comm`) and the single-device references they must match (`reference`). See docs/parallel.md.

Importing this package does not import JAX state-changing code: `parallel.mesh.set_cpu_device_count` and
`init_distributed` must run before any JAX computation.
"""
