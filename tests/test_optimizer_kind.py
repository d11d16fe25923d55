"""The optimizer kind descriptors (csrc/engine/optimizer_kind.h): the one internal list of each
kind's hyper-parameters and states, read by the step plan, the engine's group check and both
surfaces. These tests tie it to the names it must agree with: the step op's schema, torch's
optimizers' options and the state keys of ampfuse's optimizers."""

import pytest
import torch

import ampfuse
from ampfuse.optim import _kind

KINDS = {"sgd": (ampfuse.optim.SGD, torch.optim.SGD), "adam": (ampfuse.optim.Adam, torch.optim.Adam)}


def _op_arguments(kind: str) -> dict[str, torch.Argument]:
    schema = getattr(torch.ops.ampfuse, f"{kind}_step_").default._schema
    return {a.name: a for a in schema.arguments}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_hyper_parameter_and_state_list_is_an_argument_of_the_kinds_step_op(kind):
    k = _kind(kind)
    args = _op_arguments(kind)
    for h in k.hyper:
        if h.option:  # the rest come from master_weights: the op's rounding_seed
            assert h.name in args, h
    assert "rounding_seed" in args
    device = [h for h in k.hyper if h.device and h.name != "lr"]
    assert device == [k.device_value]
    assert "lr_tensor" in args and f"{k.device_value.name}_tensor" in args
    for arg in k.absmax:
        assert arg in args and str(args[arg].type) == "Optional[List[Tensor]]", arg
    for key in k.states:
        assert any(name.startswith(key) and str(a.type) == "List[Tensor]" for name, a in args.items()), key


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_option_the_kind_reads_is_an_option_of_torchs_optimizer_and_ampfuses(kind):
    ours, theirs = KINDS[kind]
    p = torch.nn.Parameter(torch.zeros(2))
    torch_defaults = theirs([p]).defaults
    our_defaults = ours([torch.nn.Parameter(torch.zeros(2))]).defaults
    k = _kind(kind)
    for h in k.hyper:
        if h.option:
            assert h.option in torch_defaults and h.option in our_defaults, h
    for gate, dtype_option in zip(k.gates, k.dtype_options):
        assert not gate or gate in torch_defaults
        assert dtype_option in our_defaults


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_plan_takes_the_kinds_hyper_parameters_by_name(kind):
    assert torch.classes.ampfuse.StepPlan(kind).hyper_names() == [h.name for h in _kind(kind).hyper]


def test_state_keys_follow_their_gate_options():
    p = torch.nn.Parameter(torch.zeros(4))
    sgd = ampfuse.optim.SGD([p], lr=0.1)
    assert sgd._state_keys_for(sgd.param_groups[0]) == ()
    sgd.param_groups[0]["momentum"] = torch.tensor(0.9)  # a device value counts as on
    assert sgd._state_keys_for(sgd.param_groups[0]) == ("momentum_buffer",)
    adam = ampfuse.optim.Adam([p], amsgrad=True, state_dtype=torch.uint8, exp_avg_sq_dtype=torch.float8_e5m2)
    group = adam.param_groups[0]
    keys = adam._state_keys_for(group)
    assert keys == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    assert adam._state_dtypes_for(group, keys) == (torch.uint8, torch.float8_e5m2, torch.float8_e5m2)


def test_an_unknown_kind_is_refused_naming_the_kinds():
    with pytest.raises(ValueError, match="unknown optimizer kind 'lamb'; the kinds are 'sgd', 'adam'"):
        torch.ops.ampfuse.optimizer_kind("lamb")


def test_a_group_without_an_option_the_kind_reads_is_refused_naming_it_before_any_change():
    p = torch.nn.Parameter(torch.ones(4))
    opt = ampfuse.optim.Adam([p], lr=0.1)
    del opt.param_groups[0]["eps"]
    p.grad = torch.ones(4)
    with pytest.raises(KeyError, match="eps"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(4)) and not opt.state[p]
    # an option groups saved by an older torch lack takes the kind's value for them
    opt = ampfuse.optim.Adam([p], lr=0.1)
    del opt.param_groups[0]["decoupled_weight_decay"]
    opt.step()
    assert torch.isfinite(p).all() and not torch.equal(p.detach(), torch.ones(4))


def test_the_optimizers_base_class_is_not_an_optimizer_of_its_own():
    class Mine(ampfuse.optim.FusedOptimizer):
        pass

    with pytest.raises(TypeError, match="subclass one of them"):
        Mine([torch.nn.Parameter(torch.zeros(2))], dict(lr=0.1, master_weights="auto"))


def test_the_step_op_refuses_a_stochastic_rounding_seed_out_of_range():
    p = torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"rounding_seed must be in \[0, 2\*\*53\), got -5"):
        ampfuse.ops.sgd_step_([p], [torch.ones(8, dtype=torch.bfloat16)], [], [], [torch.zeros(())], lr=0.1,
                              rounding_seed=-5)
    assert not p.any()
