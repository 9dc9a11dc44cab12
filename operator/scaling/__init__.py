"""Per-role scaling: what the metrics say (`signals`), the replica count the planner wants (`planner`), and
how a role goes from n to fewer replicas without cutting a request (`retire`). Pure: `control/` scrapes,
patches and deletes."""
