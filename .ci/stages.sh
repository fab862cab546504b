# Stage bookkeeping for .ci/run (sourced): each stage is announced with the seconds since the start,
# every exit prints how long each stage took, and the run fails once it has taken longer than its budget.
#
#   ci_begin             start the clock (also installs the EXIT trap that prints the stage times)
#   stage "name"         close the stage before (its time is noted) and open this one
#   ci_stage_times       the table: one line per stage, its seconds, then the total
#   ci_within_budget     fail (exit 1) when the run so far has passed CI_BUDGET_S seconds (default 4000)
#
# CI's hard limit is 5,400 s; the budget keeps a run that drifts towards it red long before it gets there.

CI_BUDGET_S=${CI_BUDGET_S:-4000}
ci_stage_names=()
ci_stage_starts=()

ci_begin() {
    ci_start=$SECONDS
    ci_stage_names=()
    ci_stage_starts=()
    trap 'ci_stage_times' EXIT
}

stage() {
    ci_stage_names+=("$*")
    ci_stage_starts+=("$SECONDS")
    echo "=== [$((SECONDS - ci_start)) s] $*"
}

ci_stage_times() {
    local now=$SECONDS count=${#ci_stage_names[@]} i end
    echo "=== stage times (s)"
    for ((i = 0; i < count; i++)); do
        if ((i + 1 < count)); then end=${ci_stage_starts[i + 1]}; else end=$now; fi
        printf '%6d  %s\n' "$((end - ci_stage_starts[i]))" "${ci_stage_names[i]}"
    done
    printf '%6d  total (budget %d s)\n' "$((now - ci_start))" "$CI_BUDGET_S"
}

ci_within_budget() {
    local elapsed=$((SECONDS - ci_start))
    if ((elapsed > CI_BUDGET_S)); then
        echo "FAIL: CI took $elapsed s, over its budget of $CI_BUDGET_S s (CI's limit is 5400 s):" \
            "find the stage that grew in the stage times below and bring it back" >&2
        return 1
    fi
    echo "CI took $elapsed s of its $CI_BUDGET_S s budget"
}
