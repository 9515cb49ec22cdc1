"""The pieces of the episode sandbox (``envs.sandbox``): a cgroup per sandbox (``cgroups``), a uid per
sandbox (``uids``) and the jail's pid 1 (``init``, run by the host's system Python)."""
