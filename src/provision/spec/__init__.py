"""The job as the user wrote it: the inventory (parse and validate), pushed files, checks
that need no network, placement, what every task sees (clusterenv), and rendering."""
