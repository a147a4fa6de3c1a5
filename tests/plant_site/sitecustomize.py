"""Put on a variant's PYTHONPATH (`distbench ab --head path=tests/plant_site,env.DISTBENCH_NUMERICS_PLANT=NAME`),
Python imports this at every interpreter's start, the variant's server and rank processes alike, and it plants
NAME (tests/numerics_plants.py) there; without the variable it does nothing."""

import os
import sys

if os.environ.get("DISTBENCH_NUMERICS_PLANT"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import numerics_plants

    numerics_plants.apply(os.environ["DISTBENCH_NUMERICS_PLANT"])
