"""The engine's shared parts, which no family owns: the arrays' edge (dispatch), checks
(validate), the dtype table, packed kernel parameters (args), the registry, plans and
their caches, the launch arithmetic and table (launch, tuning), the kernel sources and
their cache (source), and the steps every family's engine takes (engine)."""
