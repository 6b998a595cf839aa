"""DiLoCo and its streaming form: rounds of local steps, the outer step, their front doors."""
