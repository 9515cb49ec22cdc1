# The mesh cases need 8 (fake CPU) devices, which XLA fixes when JAX starts: they run in their own
# processes (test_mesh_cases.py), never inside this one, where JAX already has one device.
collect_ignore = ["cases"]
