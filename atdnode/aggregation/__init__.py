"""One-time aggregation (VGS-ATD): modes, weightings, verification and the keep decision."""
