"""Model names: MODEL served under its id (a hub id whole, a folder's name), MODEL_NAME's aliases added
before it."""

from service.settings import Settings


def test_a_hub_id_is_served_whole_and_a_folder_by_its_name(tiny_model_dir):
    assert Settings(model="Qwen/Qwen2.5-0.5B-Instruct").served_model_names == ("Qwen/Qwen2.5-0.5B-Instruct",)
    assert Settings(model=str(tiny_model_dir) + "/").served_model_names == (tiny_model_dir.name,)
    assert Settings(model="./models/qwen").served_model_name == "qwen"


def test_aliases_are_added_before_the_model_id_and_the_first_is_the_default(tiny_model_dir):
    settings = Settings(model="Qwen/Qwen2.5-0.5B-Instruct", model_name=" a ,b,, Qwen/Qwen2.5-0.5B-Instruct,a")
    assert settings.served_model_names == ("a", "b", "Qwen/Qwen2.5-0.5B-Instruct")
    assert settings.served_model_name == "a"
    assert Settings(model=str(tiny_model_dir)).served_model_name == tiny_model_dir.name
