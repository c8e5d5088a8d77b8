"""`moet plan`'s model: a checkpoint's geometry from its headers, where its tiers fit, and the decode speed to expect."""
