"""Deciding: the sharding ILP, the stage DP and the pipeline search, behind one driver.

``driver.solve`` is the only search (what ``autopar.plan``, ``autopar.parallelize`` and the
CLI call); ``pins`` checks the pins, ``meshes`` lists the meshes to try, ``flat`` solves one
stage (the ILP over meshes and recomputation), ``pipeline_search`` plans a pinned pipeline,
``pipeline_free`` searches pipeline degrees, ``pipeline_price`` prices them, ``errors``
holds the typed planning errors.
"""
