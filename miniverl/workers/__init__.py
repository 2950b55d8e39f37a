"""The three actors as plain classes: a test builds them in-process; miniverl.cluster.actors makes them Ray actors."""
