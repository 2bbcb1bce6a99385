"""What a plan costs: the sharding choices of every op (``problem``), the cost model over
them (``costing``: compute, collectives, memory, overlap), a plan's prices by node
(``prices``) and a pipeline schedule's timeline (``simulate``).

Below the solver, which searches with them, and beside what reads a plan's price without
searching: the runtime's timing report and the viewer's ``explain`` and charts.
"""
