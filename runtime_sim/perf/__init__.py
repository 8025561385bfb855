"""What every op costs: the machine model, cost formulas, scheduler, memory plan, reports and cost-only runs."""
