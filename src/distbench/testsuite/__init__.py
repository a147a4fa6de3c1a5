"""The pytest session: the plugin, the lanes that spread cases over devices, the plan they follow, the watches
that report on a session, and claims about time that may come out undecided."""
